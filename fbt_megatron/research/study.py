"""Read-outs and report of the feedback study (``tools/feedback_study.py``).

A run is read out once (cached in ``RUN/readouts.json``): validation loss at 1, 2, 3 passes and at the
exact recurrence, held-out arithmetic under the decodings of :data:`DECODINGS`, the fusion's state at
each kept checkpoint, the one-step map's spectral norm at the exact recurrence (does the pass-to-pass
map contract?); for the state-tracking task, accuracy per number of composed steps.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time
from pathlib import Path

from fbt_megatron.files import write_text_atomic

# The held-out arithmetic's decodings, name: (TextGenerator mode, prompt prefill passes, label). Feedback
# decoding after a 1-pass prefill, the paper's FUSED 2-pass prefill and the exact recurrence.
DECODINGS = {"standard": ("standard", 1, "standard"),
             "feedback": ("feedback", 1, "feedback, 1-pass prefill"),
             "feedback_fused": ("feedback", 2, "feedback, FUSED (2-pass) prefill"),
             "feedback_exact": ("feedback", "exact", "feedback, exact recurrence")}
DECODING = [(name, mode, passes) for name, (mode, passes, _) in DECODINGS.items()]  # as sft.measure takes them
SATURATED = 0.05  # a gate entry below this or above 1 - this is saturated
ONE_STEP_POSITIONS = (8, 32, 64, 96, 120)  # as tools/fixed_point.py
# The validation set of a read-out: "held_out", the held-out documents of each source read whole, the sources weighted
# as in the mix, the same tokens for every seed (data.loaders.held_out_sets; studies with a data order per
# seed); "recipe", the run's own validation sample (build_valid_batches; the earlier studies, one data order).
VALIDATIONS = {"held_out": "the held-out documents of each source, weighted as in the mix, the same for every seed",
               "recipe": "the run's validation sample (data.valid_sequences, drawn with its data seed)"}


def paired(a: list[float], b: list[float]) -> tuple[float, float, int]:
    """Mean and standard error over seeds of b - a (same seeds, same data order), and the count."""
    d = [y - x for x, y in zip(a, b) if x is not None and y is not None and math.isfinite(x) and math.isfinite(y)]
    if not d:
        return float("nan"), float("nan"), 0
    return statistics.fmean(d), (statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")), len(d)


def t_critical(df: int, confidence: float = 0.95) -> float:
    """Student's t quantile for a two-sided ``confidence`` interval with ``df`` degrees of freedom."""
    from scipy.stats import t

    return float(t.ppf(0.5 + confidence / 2, df))


def t_interval(mean: float, err: float, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The paired t-test's interval for a mean difference over ``n`` seeds with standard error ``err``:
    mean ± t(df = n - 1) · err; (nan, nan) below two seeds. With two or three seeds, t is 12.7 or 4.3,
    so twice the standard error would be far too narrow."""
    if n < 2 or not (math.isfinite(mean) and math.isfinite(err)):
        return float("nan"), float("nan")
    half = t_critical(n - 1, confidence) * err
    return mean - half, mean + half


def difference_interval(a: tuple[float, float, int], b: tuple[float, float, int],
                        confidence: float = 0.95) -> tuple[float, float, float]:
    """b - a for two independent paired means ``(mean, err, n)`` (e.g. a gap at two sizes): the difference
    and its interval with the standard errors added in quadrature and df = min(n) - 1 (conservative)."""
    diff = b[0] - a[0]
    err = math.hypot(a[1], b[1])
    lo, hi = t_interval(diff, err, min(a[2], b[2]), confidence)
    return diff, lo, hi


def verdict(lo: float, hi: float, claim_sign: int) -> str:
    """``supported`` when the interval lies on the claim's side of zero (``claim_sign`` -1: the claim is a
    negative difference), ``ruled out`` when it lies on the other side, else ``undecided``."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo <= 0 <= hi:
        return "undecided"
    return "supported" if (lo > 0) == (claim_sign > 0) else "ruled out"


def ci_text(mean: float, err: float, n: int, digits: int = 3) -> str:
    """``+0.089 [+0.068, +0.111]``: a mean difference and its 95 % t-interval (the mean alone below two seeds)."""
    if not math.isfinite(mean):
        return "n/a"
    lo, hi = t_interval(mean, err, n)
    return f"{mean:+.{digits}f}" + (f" [{lo:+.{digits}f}, {hi:+.{digits}f}]" if math.isfinite(lo) else "")


def fusion_state(model, recipe, initial: dict | None) -> dict:
    """The fusion at one checkpoint: the share of saturated entries of sigmoid(W_G e + b_G) (glu only) over the
    vocabulary's embeddings, and the relative distance of W_U (from value_init_scale * I under the
    identity init) and of W_G (from ``initial``, the last checkpoint before the switch) from their start."""
    import torch

    fb = model.feedback
    if fb is None:
        return {}
    out = {}
    if recipe.feedback.fusion == "glu":  # the additive fusion has no sigmoid to saturate
        emb = model.gpt.embedding.word_embeddings.weight[: recipe.model.vocab_size].detach()
        bias = fb.gate.bias.detach() if getattr(fb.gate, "bias", None) is not None else 0.0
        gate = torch.sigmoid(emb @ fb.gate.weight.detach().t() + bias)
        out = {"gate_saturated": float(((gate < SATURATED) | (gate > 1 - SATURATED)).float().mean()),
               "gate_mean": float(gate.mean()), "gate_std": float(gate.std())}
    w_u, w_g = fb.value.weight.detach(), fb.gate.weight.detach()
    if recipe.feedback.value_init == "identity":
        scale = recipe.feedback.value_init_scale or 2.0 * recipe.model.init_method_std
        start = scale * torch.eye(w_u.shape[0])
        out["w_u_from_init"] = float((w_u - start).norm() / start.norm())
    if initial is not None:
        out["w_g_from_init"] = float((w_g - initial["w_g"]).norm() / initial["w_g"].norm())
        if "w_u_from_init" not in out:
            out["w_u_from_init"] = float((w_u - initial["w_u"]).norm() / initial["w_u"].norm())
    out["w_u_norm"] = float(torch.linalg.matrix_norm(w_u, ord=2))
    return out


def fusion_history(run_dir: Path) -> list[dict]:
    """:func:`fusion_state` at every kept checkpoint of a run, oldest first."""
    from fbt_megatron.checkpoint.model import load_checkpoint_model

    steps = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir())
    rows, initial = [], None
    for path in steps:
        model, recipe, _ = load_checkpoint_model(path)
        if model.feedback is None:
            return []
        step = int(path.name.split("_")[1])
        if step <= recipe.schedule.feedback_start_step:  # untouched by training until the switch
            initial = {"w_u": model.feedback.value.weight.detach().clone(),
                       "w_g": model.feedback.gate.weight.detach().clone()}
        rows.append({"step": step, **fusion_state(model, recipe, initial)})
    return rows


def state_accuracy(model, batches: list[dict], passes: list[int]) -> dict:
    """State-tracking accuracy per position (position t needs t + 1 composed steps) at each pass count
    over the validation sequences ``batches``."""
    import torch

    out = {}
    with torch.no_grad():
        for k in passes:
            hits = []
            for b in batches:
                logits = model(b["input_ids"], b["position_ids"], b["doc_start"], num_passes=k).logits
                hits.append((logits.argmax(-1) == b["labels"]).float())
            per_position = torch.cat(hits).mean(0)
            out[str(k)] = [float(x) for x in per_position]
    return out


def accuracy_past_layer_count(readout: dict) -> dict[str, float] | None:
    """Mean state-tracking accuracy at each pass count over the positions past the model's layer count L
    (position t needs t + 1 composed steps: t >= L), goal (c)'s measure; None where the read-out does not
    record ``num_layers``; NaN for a sequence no longer than L. Past L a fixed-depth stack can no longer
    compose one step per layer."""
    layers, acc = readout.get("num_layers"), readout.get("state_accuracy")
    if layers is None or acc is None:
        return None
    return {k: statistics.fmean(v[layers:]) if len(v) > layers else float("nan") for k, v in acc.items()}


def answer_readout(run_dir: Path, problems: int, loaded) -> dict:
    """Held-out arithmetic: answer NLL per token (the answer scored as decoding reads it) and greedy
    exact match, per decoding mode, of ``loaded`` (the run's :func:`load_for_inference` result)."""
    from fbt_megatron.generate.api import TextGenerator
    from fbt_megatron.research.sft import held_out_problems, measure

    pairs = held_out_problems(problems)
    modes = DECODING if loaded.feedback_config.fusion != "off" else DECODING[:1]
    exact = measure(run_dir, pairs, chat=False, modes=modes, max_new_tokens=64, loaded=loaded)
    out = {}
    for name, mode, k in modes:
        gen = TextGenerator(loaded, mode=mode, prefill_passes=k)
        contexts = [gen.encode(f"Question: {q}\nAnswer:") for q, _ in pairs]
        answers = [gen.encode(f" {a}") for _, a in pairs]
        per_problem = [-ll / len(a) for (ll, _), a in zip(gen.decoder.score(contexts, answers), answers)]
        out[name] = {"answer_nll": statistics.fmean(per_problem), "per_problem_nll": per_problem,
                     "exact_match": exact[name]["exact_match"], "correct": exact[name]["correct"]}
    return out


def one_step_readout(model, input_ids, passes: int) -> dict:
    """sigma_max of the one-step map d h_t / d h_{t-1} (tools/fixed_point.py's measure) at the top states
    after ``passes`` passes of ``input_ids``' first row, at :data:`ONE_STEP_POSITIONS` inside the row:
    below 1, an error in a fed-back state shrinks as it travels along the sequence. The row is read as one
    sequence (no document resets), as tools/fixed_point.py reads it."""
    from fbt_megatron.research.fixed_point import iterate_passes, one_step_jacobian_norms

    ids = input_ids[:1]
    positions = [t for t in ONE_STEP_POSITIONS if t < ids.shape[1]]
    if not positions:
        raise ValueError(f"one-step read-out: rows of {ids.shape[1]} tokens hold none of the positions {ONE_STEP_POSITIONS}")
    top = iterate_passes(model, ids, passes)["top"]
    norms = one_step_jacobian_norms(model, ids, top, positions)
    return {"positions": [n["position"] for n in norms], "spectral_norm": [n["spectral_norm"] for n in norms]}


def relative_to_run(path, run_dir: Path) -> str:
    """``path`` relative to its run folder (a report names no machine's paths); as given if outside it."""
    try:
        return str(Path(path).resolve().relative_to(Path(run_dir).resolve()))
    except ValueError:
        return str(path)


def validation_sets(recipe, validation: str, smoke: bool = False) -> list[tuple[str, float, list[dict]]]:
    """``[(source, share, batches)]`` a read-out validates on (see :data:`VALIDATIONS`); ``smoke``: the held-out
    sets cut to the recipe's ``data.valid_sequences`` rows a source."""
    from fbt_megatron.data.loaders import build_valid_batches, held_out_sets

    if validation == "held_out":
        return held_out_sets(recipe, max_rows=recipe.data.valid_sequences if smoke else None)
    if validation == "recipe":
        return [("valid", 1.0, build_valid_batches(recipe, 0, 1))]
    raise ValueError(f"validation: {validation!r} is none of {sorted(VALIDATIONS)}")


def made_from_latest(readouts: dict, run_dir: Path) -> bool:
    """Whether cached ``readouts`` were made from the run's latest checkpoint, by its step folder's name (a
    cache may name it relative to the run or by an absolute path, of a folder since moved; a re-save's
    ``.old`` aside is the same step); True where the run keeps no checkpoint (the cache is all there is)."""
    from fbt_megatron.checkpoint.discovery import CheckpointError, resolve_checkpoint

    try:
        latest = resolve_checkpoint(run_dir)
    except CheckpointError:
        return True
    cached = readouts.get("checkpoint")
    return cached is not None and Path(cached).name.removesuffix(".old") == latest.name.removesuffix(".old")


def read_out(run_dir: Path, smoke: bool = False, validation: str = "held_out") -> dict:
    """Every read-out of one finished run (cached in ``run_dir/readouts.json``, read again when it was made
    on another ``validation`` set, :data:`VALIDATIONS`, or from another checkpoint than the run's latest: a
    run read out when stopped early and trained on since). Call in a world-of-one process group."""
    cache = run_dir / "readouts.json"
    if cache.is_file():
        out = json.loads(cache.read_text())
        if out.get("validation", "recipe") == validation and made_from_latest(out, run_dir):
            if "val_loss" not in out or out.get("fusion") == "off" or "one_step" in out:
                return out
            # read out before the one-step measure existed: add it to the cache
            from fbt_megatron.checkpoint.model import load_checkpoint_model

            model, recipe, _ = load_checkpoint_model(run_dir)
            out["one_step"] = one_step_readout(model, validation_sets(recipe, validation, smoke)[0][2][0]["input_ids"],
                                               recipe.data.seq_length)
            write_text_atomic(cache, json.dumps(out, indent=1))
            return out
    from fbt_megatron import runtime
    from fbt_megatron.checkpoint.model import load_checkpoint_model
    from fbt_megatron.parallel.runner import get_runner
    from fbt_megatron.train.train_step import evaluate

    started = time.perf_counter()
    model, recipe, latest = load_checkpoint_model(run_dir)
    seq = recipe.data.seq_length
    cached_exact = recipe.model.attention_mask == "document_causal"  # else seq Jacobi passes
    passes = [1] if model.feedback is None else [1, 2, 3, seq]  # seq passes: the exact recurrence
    sets = validation_sets(recipe, validation, smoke)
    out: dict = {"checkpoint": relative_to_run(latest, run_dir), "seq_length": seq, "num_layers": recipe.model.num_layers,
                 "fusion": recipe.feedback.fusion, "validation": validation,
                 "validation_tokens": {name: int(sum(b["loss_mask"].sum() for b in batches)) for name, _, batches in sets}}
    if recipe.data.source == "synthetic" and recipe.data.synthetic.task == "state_tracking":
        out["state_accuracy"] = state_accuracy(model, sets[0][2], passes)
    else:
        from fbt_megatron.generate.loading import load_for_inference
        from fbt_megatron.generate.recurrence import exact_recurrence_loss

        runner = get_runner(model)
        loaded = load_for_inference(latest)  # the inference model, once: the exact loss and the answers
        # the exact recurrence through the KV cache (one pass of compute) where its documents are independent
        by_source = {name: {str(k): exact_recurrence_loss(loaded.model, batches) if k == seq and cached_exact
                            else evaluate(runner, batches, k, runtime.device()).loss for k in passes}
                     for name, _, batches in sets}
        out["val_loss"] = {str(k): sum(share * by_source[name][str(k)] for name, share, _ in sets) for k in passes}
        out["val_loss_by_source"] = by_source
        out["validation_shares"] = {name: share for name, share, _ in sets}
        if model.feedback is not None:
            out["one_step"] = one_step_readout(model, sets[0][2][0]["input_ids"], seq)
        out["answers"] = answer_readout(run_dir, 8 if smoke else 100, loaded)
    out["fusion_history"] = fusion_history(run_dir)
    out["seconds"] = round(time.perf_counter() - started, 1)  # the read-out's wall time, to plan a study
    write_text_atomic(cache, json.dumps(out, indent=1))
    return out


class _NoAxes:
    """Stands in for a matplotlib axis when matplotlib is not installed."""

    def __getattr__(self, name):
        return lambda *a, **k: None


def _by_kind(names) -> dict[str, list[tuple[int, str]]]:
    """``{kind: [(seed, run name), ...]}`` for run names ``KIND_seedS``."""
    out: dict[str, list[tuple[int, str]]] = {}
    for name in names:
        kind, _, seed = name.rpartition("_seed")
        out.setdefault(kind, []).append((int(seed), name))
    return {k: sorted(v) for k, v in out.items()}


def _pm(mean: float, err: float, digits: int = 3) -> str:
    if not math.isfinite(mean):
        return "n/a"
    return f"{mean:+.{digits}f}" + (f" ± {err:.{digits}f}" if math.isfinite(err) else "")


def same_change_baseline(kind: str, kinds: dict) -> str | None:
    """The model change X of an FBT ablation ``fbt[_heavy]_X[_more]`` that has a standard run ``standard_X``
    (the longest such X): ``fbt_heavy_untied_fusion_lr_x10`` is compared with ``standard_untied``, since a
    fusion-only change does nothing to a model without the fusion. A run of other steps (``..._stepsN_...``)
    is compared only with a standard run of the same steps: anything else would not be equal tokens."""
    for base in ("fbt_heavy", "fbt"):
        if kind.startswith(f"{base}_"):
            suffix = kind[len(base) + 1:]
            steps = re.search(r"_steps\d+(?=_|$)", suffix)
            changes = [k[len("standard_"):] for k in kinds if k.startswith("standard_")
                       and (suffix == k[len("standard_"):] or suffix.startswith(k[len("standard_"):] + "_"))
                       and (steps is None or k.endswith(steps.group()))]
            return max(changes, key=len) if changes else None
    return None


def recipe_variant_base(kind: str, kinds: dict) -> str | None:
    """The run ``BASE`` that FBT kind ``BASE_VARIANT`` changes one recipe setting of (E1: ``loss_mean``,
    ``switch50``), if the study has it."""
    for variant in ("loss_mean", "switch50"):
        if kind.endswith(f"_{variant}") and kind[: -len(variant) - 1] in kinds:
            return kind[: -len(variant) - 1]
    return None


def paired_by_seed(base: dict[int, float], other: dict[int, float]) -> tuple[float, float, int]:
    """:func:`paired` over the seeds both runs have: ``other - base`` seed by seed (``{seed: value}``)."""
    common = [s for s in other if s in base]
    return paired([base[s] for s in common], [other[s] for s in common])


def summarise(summaries: dict, readouts: dict) -> dict:
    """The study's comparisons, each a paired difference over seeds (mean, standard error, seeds): per FBT
    kind, k-pass - 1-pass and its best mode against the standard baselines; per state-task FBT kind, the
    accuracy past the layer count under the exact recurrence against 1 pass, against ``state_standard`` and
    against ``state_standard_X`` for a model change X (no row where a read-out lacks ``num_layers``)."""
    kinds = _by_kind(summaries)
    val = {name: r.get("val_loss", {}) for name, r in readouts.items()}
    rows = {}
    standard = {s: val[n]["1"] for s, n in kinds.get("standard", [])}
    for kind, runs in kinds.items():
        if kind.startswith("state_") or kind.startswith("standard"):
            continue
        seeds = [s for s, _ in runs]
        one = [val[n].get("1") for _, n in runs]
        seq = str(readouts[runs[0][1]]["seq_length"])
        row = {"seeds": seeds}
        for k in ("2", "3", seq):
            label = "exact" if k == seq else f"{k}-pass"
            row[f"{label} - 1-pass"] = paired(one, [val[n].get(k) for _, n in runs])
        # one mode for every seed: the lowest mean over seeds (a per-seed minimum would favour FBT by chance)
        means = {k: statistics.fmean(val[n][k] for _, n in runs) for k in val[runs[0][1]]}
        row["best mode"] = min(means, key=means.get)
        best = {s: val[n][row["best mode"]] for s, n in runs}
        row["best mode - standard (equal tokens)"] = paired_by_seed(standard, best)
        change = same_change_baseline(kind, kinds)
        if change:  # an ablation that changes the model itself, e.g. untied
            same = {s: val[n]["1"] for s, n in kinds[f"standard_{change}"]}
            row[f"best mode - standard_{change} (same change, equal tokens)"] = paired_by_seed(same, best)
            row[f"1-pass - standard_{change} (FBT's 1-pass deficit)"] = paired_by_seed(
                same, {s: val[n]["1"] for s, n in runs})
        base = recipe_variant_base(kind, kinds)
        if base:  # a change to the training recipe (E1): its best mode against the unchanged run's
            base_runs = kinds[base]
            base_means = {k: statistics.fmean(val[n][k] for _, n in base_runs) for k in val[base_runs[0][1]]}
            base_mode = min(base_means, key=base_means.get)
            row[f"best mode - {base} best mode ({base_mode} passes; the recipe change)"] = paired_by_seed(
                {s: val[n][base_mode] for s, n in base_runs}, best)
        compute = {s: val[n]["1"] for s, n in kinds.get(f"standard_compute_{kind}", [])}
        row["best mode - standard (equal compute)"] = paired_by_seed(compute, best)
        rows[kind] = row
    def standard_past(kind: str) -> dict[int, float]:  # a standard state run's 1-pass accuracy past L, by seed
        past = {s: accuracy_past_layer_count(readouts[n]) for s, n in kinds.get(kind, [])}
        return {s: p["1"] for s, p in past.items() if p is not None}

    state_standard = standard_past("state_standard")
    state_kinds = {k[len("state_"):]: v for k, v in kinds.items() if k.startswith("state_")}
    for kind, runs in kinds.items():
        if not kind.startswith("state_") or kind.startswith("state_standard"):
            continue
        past = {s: accuracy_past_layer_count(readouts[n]) for s, n in runs}
        if any(p is None for p in past.values()):
            continue
        seq = str(readouts[runs[0][1]]["seq_length"])
        exact = {s: p.get(seq) for s, p in past.items()}
        rows[kind] = {
            "seeds": [s for s, _ in runs],
            "state accuracy past the layer count: exact - 1-pass (same model)":
                paired_by_seed({s: p["1"] for s, p in past.items()}, exact),
            "state accuracy past the layer count: exact - state_standard": paired_by_seed(state_standard, exact)}
        change = same_change_baseline(kind[len("state_"):], state_kinds)
        if change:  # e.g. untied: against the standard model with the same change
            rows[kind][f"state accuracy past the layer count: exact - state_standard_{change} (same change)"] = \
                paired_by_seed(standard_past(f"state_standard_{change}"), exact)
    return rows


# The questions a study page opens with: (question, the comparisons that answer it, the claim's sign, what
# would change the answer). A comparison is named by the end of its name; for each variant the first name
# that matches is used (a baseline with the same model change before the plain standard model).
QUESTIONS = [
    ("Is a fed-back model ahead of the standard model at equal tokens?",
     ("(same change, equal tokens)", "best mode - standard (equal tokens)"), -1,
     "a variant whose interval lies below 0; more seeds for the undecided ones"),
    ("Do 2 passes beat 1 pass of the same model?", ("2-pass - 1-pass",), -1,
     "more seeds for the undecided ones; a larger model or budget"),
    ("Is FBT's 1-pass mode behind the standard model with the same change?", ("(FBT's 1-pass deficit)",), 1,
     "a recipe that supervises the 1-pass mode more (E1)"),
    ("Does the recipe change beat the unchanged recipe?", ("; the recipe change)",), -1,
     "three seeds of each on distinct data orders (E1)"),
    ("Does feedback decoding track the state past the layer count better than 1 pass of the same model?",
     ("state accuracy past the layer count: exact - 1-pass (same model)",), 1, "more seeds; a larger model"),
    ("Does feedback decoding track the state past the layer count better than a standard model?",
     ("(same change)", "state accuracy past the layer count: exact - state_standard"), 1,
     "more seeds; a larger model"),
]


def _answering(row: dict, endings: tuple[str, ...]):
    """The first of ``row``'s comparisons, in the order of ``endings``, that has seeds (None: none has)."""
    for ending in endings:
        for name, value in row.items():
            if name not in ("seeds", "best mode") and name.endswith(ending) and value[2] > 0:
                return value
    return None


def summary_rows(comparisons: dict) -> list[list[str]]:
    """One row per question of :data:`QUESTIONS` the study's comparisons answer: how many variants support,
    rule out or leave undecided the claim (95 % t-intervals), and, among the variants with the most seeds,
    the one furthest on the claim's side."""
    rows = []
    for question, endings, sign, change in QUESTIONS:
        found = [(kind, v) for kind, row in comparisons.items() if (v := _answering(row, endings)) is not None]
        if not found:
            continue
        one_seed = "with one seed (no interval)"
        verdicts = [verdict(*t_interval(*v[:3]), sign) if v[2] > 1 else one_seed for _, v in found]
        counts = ", ".join(f"{verdicts.count(w)} {w}" for w in ("supported", "ruled out", "undecided", one_seed)
                           if verdicts.count(w))
        most_seeds = max(v[2] for _, v in found)
        kind, best = min(((k, v) for k, v in found if v[2] == most_seeds),
                         key=lambda f: -sign * f[1][0] if math.isfinite(f[1][0]) else math.inf)
        rows.append([question, f"{counts} (of {len(found)} variant{'s' if len(found) > 1 else ''})",
                     f"{kind}: {ci_text(*best[:3])} ({best[2]} seed{'s' if best[2] > 1 else ''})", change])
    return rows


def portable_args(args: dict) -> dict:
    """The study's arguments with its folders (``runs``, ``out``) relative to the repository, or by name
    when outside it: a report names no machine's paths."""
    from fbt_megatron.research.runs import ROOT

    out = dict(args)
    for key in ("runs", "out"):
        if out.get(key):
            path = Path(out[key]).resolve()
            out[key] = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    return out


def study_command(args) -> str:
    """The command that rebuilds a report from its runs (as printed: it summarises or reuses, never retrains)."""
    recipe = getattr(args, "fbt_recipe", "base")
    options = (("seeds", args.seeds), ("groups", args.groups), ("scale", args.scale), ("steps", args.steps),
               ("lr", args.lr), ("only", args.only), ("fbt_recipe", recipe if recipe != "base" else None))
    return "python tools/feedback_study.py " + " ".join(
        [f"--{k.replace('_', '-')} {v}" for k, v in options if v]
        + (["--shared-data-order"] if getattr(args, "shared_data_order", False) else [])
        + (["--summarise-only"] if getattr(args, "summarise_only", False)
           else ["--reuse"] if getattr(args, "reuse", False) else []))


def validation_text(readouts: dict) -> str:
    """One sentence naming the set the language-model read-outs validated on."""
    lm = [r for r in readouts.values() if "val_loss" in r]
    kinds = {r.get("validation", "recipe") for r in lm}
    if not kinds:  # no language-model run
        return ""
    if kinds == {"held_out"}:
        tokens = lm[0].get("validation_tokens", {})
        counts = ", ".join(f"{name} {n:,}" for name, n in tokens.items())
        return (f"Read-outs validate on the held-out documents of each source, read whole ({counts} tokens), the sources "
                "weighted as in the mix: the same tokens for every run and seed. The curves are each run's own "
                "validation sample (drawn with its data seed).")
    if kinds == {"recipe"}:
        return "Validation on held-out documents of the embedded mix (each run's validation sample)."
    return ("Read-outs on two validation sets: " + "; ".join(sorted(VALIDATIONS[k] for k in kinds if k in VALIDATIONS))
            + ". Read the runs out again on one before comparing them.")


def source_table(lm: dict, readouts: dict, comparisons: dict) -> str:
    """Per source, each language-model kind's 1-pass and best-mode loss, means over seeds ("" where the
    read-outs have no per-source losses)."""
    from fbt_megatron.research.report import table

    rows, names = [], None
    for kind, runs in sorted(lm.items()):
        r = [readouts[n] for _, n in runs]
        if not all("val_loss_by_source" in x for x in r):
            return ""
        names = names or list(r[0]["val_loss_by_source"])
        best = comparisons.get(kind, {}).get("best mode", "1")
        rows.append([kind, ",".join(str(s) for s, _ in runs)]
                    + [" / ".join("%.3f" % statistics.fmean(x["val_loss_by_source"][name][k] for x in r)
                                  for k in dict.fromkeys(["1", best])) for name in names])
    return table(["run", "seeds", *names], rows) if rows and len(names) > 1 else ""  # one source: the main table


def render(summaries: dict, readouts: dict, seeds: list[int], args, seconds: float, out_dir: Path,
           stem: str = "feedback_study", kept: dict | None = None, diverged: dict | None = None) -> Path:
    """``out_dir/STEM.{md,json,png}`` from the finished runs. ``kept``: runs recorded in the report before
    (``{run: {"val_history", "readouts"}}``) that this one does not select: written to its JSON unchanged
    and named in it, so that a narrower report never drops a run whose folder may be gone. ``diverged``:
    ``{run: stop reason}`` of runs that stopped on non-finite losses, named in the markdown and the JSON (a
    result too; a run trained again that diverged replaces its earlier record)."""
    diverged = diverged or {}
    kept = {n: r for n, r in (kept or {}).items() if n not in summaries and n not in diverged}
    import numpy as np

    from fbt_megatron.research.report import figure, mean_std, provenance, save, table

    kinds = _by_kind(summaries)
    comparisons = summarise(summaries, readouts)
    lm = {k: v for k, v in kinds.items() if not k.startswith("state_")}
    try:
        fig, axes = figure(ncols=2, width=6.0, height=4.2)
        plot = f"![curves and state tracking]({stem}.png)"
    except ImportError:  # the research extra is not installed: tables only
        fig, axes = None, [_NoAxes(), _NoAxes()]
        plot = "(no plot: `pip install -e '.[research]'` for matplotlib)"
    for i, (kind, runs) in enumerate(sorted(lm.items())):
        hist = [{v["step"]: v["loss"] for v in summaries[n]["val_history"]} for _, n in runs]
        steps = sorted(set.intersection(*(set(h) for h in hist)))  # by step: a stopped run's extra point
        for passes, style in (("1", "-"), ("2", "--"), ("3", ":")):
            if not steps or passes not in hist[0][steps[0]]:
                continue
            curve = np.array([[h[step][passes] for step in steps] for h in hist]).mean(0)
            axes[0].plot(steps, curve, style, color=f"C{i}",
                         label=f"{kind}, {passes}-pass" if kind != "standard" or passes == "1" else kind)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("held-out validation loss (mean over seeds)")
    axes[0].legend(fontsize=6)
    loss_rows, answer_rows = [], []
    for kind, runs in sorted(lm.items()):
        r = [readouts[n] for _, n in runs]
        seq = str(r[0]["seq_length"])
        cells = [kind, ",".join(str(s) for s, _ in runs)]
        for k in ("1", "2", "3", seq):
            cells.append("%.3f ± %.3f" % mean_std([x["val_loss"].get(k) for x in r]) if k in r[0]["val_loss"] else "-")
        ans = [x["answers"] for x in r]
        answer_rows.append([kind, cells[1]] + ["%.3f / %.3f" % (statistics.fmean(a[name]["answer_nll"] for a in ans),
                                                                statistics.fmean(a[name]["exact_match"] for a in ans))
                                               if all(name in a for a in ans) else "-" for name in DECODINGS])
        sigma = [statistics.fmean(x["one_step"]["spectral_norm"]) for x in r if x.get("one_step")]
        cells.append("%.2f ± %.2f" % mean_std(sigma) if len(sigma) == len(r) else "-")
        fus = [x["fusion_history"][-1] for x in r if x["fusion_history"]]
        cells.append("%.2f / %.2f" % (statistics.fmean(f.get("gate_saturated", float("nan")) for f in fus),
                                      statistics.fmean(f.get("w_u_from_init", float("nan")) for f in fus))
                     if fus else "-")
        loss_rows.append(cells)
    state_rows = []
    for i, (kind, runs) in enumerate(sorted(k for k in kinds.items() if k[0].startswith("state_"))):
        acc = [readouts[n]["state_accuracy"] for _, n in runs]
        past = [accuracy_past_layer_count(readouts[n]) for _, n in runs]
        for k in acc[0]:
            curve = np.array([a[k] for a in acc]).mean(0)
            label = f"{kind}, {'exact' if int(k) > 3 else k + '-pass'}"
            axes[1].plot(np.arange(1, len(curve) + 1), curve, "-" if k == "1" else "--", color=f"C{i}", label=label)
            state_rows.append([label, ",".join(str(s) for s, _ in runs)]
                              + [f"{curve[j - 1]:.3f}" for j in (1, 2, 4, 8, 16, len(curve))]
                              + [f"{statistics.fmean(p[k] for p in past):.3f}" if None not in past else "-"])
    axes[1].set_xlabel("composed steps (position + 1)")
    axes[1].set_ylabel("state-tracking accuracy")
    axes[1].legend(fontsize=6)
    comp_rows = [[kind, name + (f" ({row['best mode']} passes)" if name.startswith("best") else ""), _pm(*v[:2]),
                  ci_text(*v[:3]), v[2]]
                 for kind, row in comparisons.items() for name, v in row.items() if name not in ("seeds", "best mode")]
    summary = summary_rows(comparisons)
    by_source = source_table(lm, readouts, comparisons)
    md = "\n".join([
        f"# Feedback study: {stem}", "",
        "Generated by the study command below; the write-up is [feedback_phase.md](feedback_phase.md).", "",
        "## Summary", "",
        "A claim is *supported* when its paired 95 % t-interval over seeds excludes 0 on the claim's side, *ruled "
        "out* when it excludes 0 on the other side. The variant shown has the most seeds and, among those, the "
        "difference furthest on the claim's side. It is picked after the fact, so its interval overstates the "
        "evidence; among ten variants, one *supported* can be chance.", "",
        table(["question", "answer", "number [95 % t-interval]", "what would change it"], summary)
        if summary else "No comparison here has seeds on both of its sides.",
        "",
        "## Runs", "",
        "Runs of `recipes/research/tiny_feedback.yaml` (WSD LR, the switch on the plateau at 20 % of the steps) "
        "and its overrides, `tools/feedback_study.py`. " + (validation_text(readouts) + " ").lstrip() +
        "*exact*: the exact recurrence (passes = sequence length). Fusion: share of saturated gate entries / W_U's relative distance from its "
        "initialisation, at the last checkpoint. One-step σ: the spectral norm of d h_t / d h_{t-1} at the exact "
        "recurrence, mean over positions 8-120 of one held-out row (< 1: the pass-to-pass map contracts). Means "
        "± standard deviation over seeds.", "",
        table(["run", "seeds", "1-pass", "2-pass", "3-pass", "exact", "one-step σ", "fusion"], loss_rows), "",
        *([f"Diverged, not read out: {'; '.join(f'{n} ({r})' for n, r in sorted(diverged.items()))}.", ""]
          if diverged else []),
        *(["Per source (mean over seeds; 1 pass / the run's best mode):", "", by_source, ""] if by_source else []),
        "## Held-out arithmetic (answer NLL per token / greedy exact match)", "",
        "The answer scored and generated as each decoding reads it. Feedback decoding differs only in how the "
        "prompt is prefilled: one pass, the paper's FUSED two passes, or the exact recurrence. Means over "
        "seeds; - where a run was read out before that decoding was.", "",
        table(["run", "seeds", *(label for _, _, label in DECODINGS.values())], answer_rows), "",
        "## Paired differences (first - second; a loss is better lower, an accuracy higher)", "",
        "Paired t-test over seeds: the mean of the per-seed differences, its standard error, and the 95 % "
        "interval mean ± t(0.975, seeds - 1) · standard error.", "",
        table(["run", "difference", "mean ± standard error", "95 % t-interval", "seeds"], comp_rows), "",
        "## State tracking (running products in S3; accuracy at a number of composed steps)", "",
        ("Mean over seeds. *past L*: the mean accuracy over the composed steps past the model's layer count "
         "(L + 1 to the last), goal (c)'s measure.\n\n"
         + table(["run", "seeds", "1", "2", "4", "8", "16", "last", "past L"], state_rows)) if state_rows else "(not run)", "",
        plot, "",
        *([f"Also recorded, not selected here (kept in the JSON for `--reuse`): {', '.join(sorted(kept))}.", ""]
          if kept else []),
        provenance(study_command(args), seconds)])
    data = {"args": portable_args(vars(args)), "seeds": seeds, "comparisons": comparisons,
            "readouts": {**readouts, **{n: r["readouts"] for n, r in kept.items()}},
            "val_history": {**{n: s["val_history"] for n, s in summaries.items()},
                            **{n: r["val_history"] for n, r in kept.items()}},
            "kept": sorted(kept), "diverged": dict(diverged)}
    return save(out_dir, stem, md, data, draw=None if fig is None else lambda: fig)  # the figure after the page
