"""Instruction tuning at small scale: accuracy and reasoning length of base vs SFT models, standard vs
feedback vs FUSED decoding (paper: FUSED helps the instruction-tuned model; shorter reasoning on base
models, which instruction tuning erases).

    python tools/sft_math.py conversations --out data/math_chat.jsonl     # the math docs as conversations
    python tools/sft_math.py run [--seeds 1,2,3] [--out docs/results]     # the whole experiment

``run``, per seed: pretrain the tiny FBT recipe (``--pretrain-steps``, feedback from 60% of them) and a
standard model (fusion off) given the same compute (steps x the FBT run's mean passes per step); turn
the embedded math documents (``Question ... Answer ... #### N``, the ones pretraining saw) into one-turn
conversations, ``fbt data prepare --format chat`` them; SFT both models (``--sft-steps``; FBT with the
75/22/3 mix from step 0, the standard model again given equal compute); then on held-out problems
(another seed, never in training) measure greedy exact match on ``#### N`` and the median / mean
generated tokens in standard / feedback / FUSED decoding (standard models: standard only), base models
prompted ``Question: q\\nAnswer:``, SFT models through the chat template; per-problem pairing of
feedback/FUSED with standard decoding. Writes docs/results/sft.{md,json,png}; ``run --render-only``
writes the page again from the recorded JSON (the page's answers are computed from its numbers).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FEEDBACK_MIX = [0.75, 0.22, 0.03]


def _env() -> dict:
    return dict(os.environ, FBT_DEVICE=os.environ.get("FBT_DEVICE", "cpu"))


def prepare_chat(work: Path, tokenizer: str, max_tokens: int) -> Path:
    from fbt_megatron.research.sft import write_conversations

    jsonl, out = work / "math_chat.jsonl", work / "math_chat"
    n = write_conversations(jsonl)
    if not (out / "index.json").is_file():
        cmd = [sys.executable, "-m", "fbt_megatron.cli", "-q", "data", "prepare", "--format", "chat", "--input",
               str(jsonl), "--tokenizer", tokenizer, "--out", str(out), "--max-tokens", str(max_tokens), "--quiet"]
        r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {r.stderr}")
        print(f"[sft] {n} conversations -> {out}: {r.stdout.strip()}", flush=True)
    return out


def runs_for_seed(seed: int, a, work: Path, chat_dir: Path) -> dict:
    """The four runs of one seed; returns their run dirs."""
    from fbt_megatron.research.runs import finished_run, train_run
    from fbt_megatron.research.sft import expected_passes

    P, S = a.pretrain_steps, a.sft_steps
    start = int(0.6 * P)
    fbt_pre = (start + (P - start) * expected_passes(FEEDBACK_MIX)) / P  # mean passes per pretraining step
    fbt_sft = expected_passes(FEEDBACK_MIX)
    d = {k: work / f"seed{seed}" / k for k in ("fbt_base", "std_base", "fbt_sft", "std_sft")}
    common = [f"seed={seed}", "eval.every=100000", "eval.at_end=false", "logging.tensorboard=false", "logging.log_every=50"]
    pre = [*common, "checkpoint.every=100000", "checkpoint.keep_last=1"]
    sft = [*common, "checkpoint.every=100000", "checkpoint.keep_last=1", f"data.pipeline.sources=[{{name: math_chat, path: {chat_dir}, weight: 1.0}}]",
           "data.pipeline.tokenizer=data/embedded/tokenizer.model", f"lr_schedule.warmup_steps={max(1, S // 20)}"]
    jobs = [
        ("fbt_base", "recipes/tiny.yaml", [*pre, f"train.steps={P}", f"schedule.feedback_start_step={start}"]),
        ("std_base", "recipes/tiny.yaml", [*pre, f"train.steps={round(P * fbt_pre)}", "feedback.fusion=off",
                                           "schedule.feedback_start_step=0", "schedule.mix=[1.0]"]),
        ("fbt_sft", "recipes/tiny_sft.yaml", [*sft, f"train.steps={S}", f"init_from={d['fbt_base']}"]),
        ("std_sft", "recipes/tiny_sft.yaml", [*sft, f"train.steps={round(S * fbt_sft)}", f"init_from={d['std_base']}",
                                              "schedule.mix=[1.0]"]),
    ]
    for name, recipe, overrides in jobs:
        if finished_run(d[name]) is not None and not a.force:
            continue
        t0 = time.perf_counter()
        s = train_run(recipe, d[name], overrides, resume=not a.force)  # a stopped run continues from its checkpoint
        print(f"[sft] seed {seed} {name}: {s['step']} steps in {time.perf_counter() - t0:.0f}s, "
              f"val loss 1 pass {s.get('val_loss_1pass')}", flush=True)
    return {k: str(v) for k, v in d.items()}


def measure_all(dirs: dict, problems, a) -> dict:
    from fbt_megatron import runtime
    from fbt_megatron.research.sft import measure

    out = {}
    runtime.init_distributed()
    try:
        for name, run in dirs.items():
            out[name] = measure(run, problems, chat=name.endswith("_sft"), max_new_tokens=a.max_new_tokens)
            print(f"[sft] {name}: " + ", ".join(f"{m} EM {r['exact_match']:.3f} median {r['median_tokens']}"
                                                for m, r in out[name].items()), flush=True)
    finally:
        runtime.shutdown()
    return out


def summarise(per_seed: list[dict]) -> list[dict]:
    from fbt_megatron.research.report import mean_std
    from fbt_megatron.research.sft import paired_lengths

    rows = []
    for model in ("fbt_base", "fbt_sft", "std_base", "std_sft"):
        for mode in ("standard", "feedback", "fused"):
            got = [s[model][mode] for s in per_seed if mode in s[model]]
            if not got:
                continue
            em, med, mean = (mean_std([g[k] for g in got]) for k in ("exact_match", "median_tokens", "mean_tokens"))
            row = {"model": model, "mode": mode, "seeds": len(got), "exact_match": em, "median_tokens": med,
                   "mean_tokens": mean}
            if mode != "standard":
                pairs = [paired_lengths(s[model]["standard"]["tokens"], s[model][mode]["tokens"]) for s in per_seed]
                row["paired_mean_diff"] = mean_std([p["mean_diff"] for p in pairs])
                row["paired_shorter_longer"] = [sum(p["shorter"] for p in pairs), sum(p["longer"] for p in pairs)]
            rows.append(row)
    return rows


SOLVES = 0.1  # exact match (mean over seeds) from which a model counts as solving the held-out problems


def _share(x: float) -> str:
    """0 -> '0', 0.02667 -> '0.027'."""
    return f"{x:.3f}".rstrip("0").rstrip(".")


def answers(data: dict) -> list[list[str]]:
    """The page's opening rows, from the recorded means over seeds. Accuracy: an SFT model solves at least
    SOLVES of the problems, more than any base model. Ending the turn: every SFT model's median length (any
    decoding) is below every base model's. Shorter answers: the 95 % t-interval over seeds of the SFT FBT
    model's paired FUSED - standard length difference lies below zero."""
    from fbt_megatron.research.study import t_interval, verdict

    rows, n_problems = data["rows"], data["args"]["problems"]
    sft = [r for r in rows if r["model"].endswith("_sft")]
    base = [r for r in rows if r["model"].endswith("_base")]
    em = [r["exact_match"][0] for r in rows]
    best_sft, best_base = max(r["exact_match"][0] for r in sft), max(r["exact_match"][0] for r in base)
    accurate = best_sft >= SOLVES and best_sft > best_base
    out = [["Does SFT give accuracy at this size?", "Yes" if accurate else "No",
            f"exact match {_share(min(em))}–{_share(max(em))} on {n_problems} held-out problems",
            "–" if accurate else "a model and data large enough to solve them"]]
    before, after = [r["median_tokens"][0] for r in base], [r["median_tokens"][0] for r in sft]
    ends = ("Yes" if max(after) < min(before) else
            "Partly" if sum(after) / len(after) < sum(before) / len(before) else "No")
    out.append(["Does SFT teach the model to end its turn?", ends,
                f"median length {min(before):.0f}–{max(before):.0f} tokens before, "
                f"{min(after):.0f}–{max(after):.0f} after",
                "–" if ends == "Yes" else "more SFT steps"])
    fused = next((r for r in sft if r["model"] == "fbt_sft" and r["mode"] == "fused"), None)
    if fused:
        m, sd = fused["paired_mean_diff"]
        n = fused["seeds"]
        lo, hi = t_interval(m, sd / math.sqrt(n), n)
        v = verdict(lo, hi, -1)
        shorter = {"supported": "Yes", "ruled out": "No"}.get(v, "A hint only" if m < 0 else "No")
        out.append(["Does feedback decoding shorten the SFT model's answers?", shorter,
                    f"FUSED {m:+.1f} ± {sd:.1f} tokens a problem against standard decoding (mean ± SD over seeds)"
                    + (f", 95% interval {lo:+.1f} to {hi:+.1f}" if math.isfinite(lo) else ""),
                    "more seeds" if v == "undecided" else "–"])
    return out


def findings(data: dict) -> list[str]:
    """The paragraphs under the table, one sentence a line: exact match per seed, and the lengths."""
    args, per_seed, rows = data["args"], data["per_seed"], data["rows"]
    N, limit = args["problems"], args["max_new_tokens"]
    accurate, ends, *shorter = [row[1] for row in answers(data)]

    def runs(kind):
        return [m for s in per_seed for name, modes in s.items() if name.endswith(kind) for m in modes.values()]

    solved = {k: [sum(m["correct"]) for m in runs(k)] for k in ("_base", "_sft")}
    at_limit = {k: [t >= limit for m in runs(k) for t in m["tokens"]] for k in ("_base", "_sft")}
    at_limit = {k: sum(v) / len(v) for k, v in at_limit.items()}
    base_em = ("0 for every base model" if not any(solved["_base"]) else
               f"{min(solved['_base'])}–{max(solved['_base'])} of {N} problems for the base models")
    acc = [f"**Accuracy.** The models are the tiny recipe (1.3 M parameters) after {args['pretrain_steps']} "
           f"pretraining and {args['sft_steps']} SFT steps."]
    if max(r["exact_match"][0] for r in rows) < SOLVES:
        acc.append("None of them solves the held-out problems.")
    acc.append(f"Per seed, exact match is {base_em} and {min(solved['_sft'])}–{max(solved['_sft'])} of {N} problems "
               "for the SFT models.")
    if accurate != "Yes":
        acc.append("The paper's instruction-tuned gain (GSM8K 67.9 → 71.8 with FUSED, at 1 B parameters and 400 B "
                   "tokens) cannot be tested at this size.")
    med = {k: [r["median_tokens"][0] for r in rows if r["model"].endswith(k)] for k in ("_base", "_sft")}
    length = [f"**Length.** {'SFT teaches the models to end their turn.' if ends == 'Yes' else ''}".rstrip(),
              f"The median length is {min(med['_base']):.0f}–{max(med['_base']):.0f} tokens for the base models "
              f"({at_limit['_base']:.0%} of their answers run to the {limit}-token limit) and "
              f"{min(med['_sft']):.0f}–{max(med['_sft']):.0f} for the SFT models "
              f"({at_limit['_sft']:.0%} at the limit)."]
    by = {(r["model"], r["mode"]): r for r in rows}
    for model, name in (("fbt_base", "base"), ("fbt_sft", "SFT")):
        if (model, "feedback") in by and (model, "fused") in by:
            f, g = by[(model, "feedback")], by[(model, "fused")]
            length.append(
                f"In the {name} FBT model, feedback and FUSED decoding change the length against its standard "
                f"decoding by {f['paired_mean_diff'][0]:+.1f} ± {f['paired_mean_diff'][1]:.1f} and "
                f"{g['paired_mean_diff'][0]:+.1f} ± {g['paired_mean_diff'][1]:.1f} tokens a problem (mean ± SD over "
                f"seeds): {f['paired_shorter_longer'][0]} and {g['paired_shorter_longer'][0]} of the "
                f"{N * len(per_seed)} problem-seed pairs shorter, {f['paired_shorter_longer'][1]} and "
                f"{g['paired_shorter_longer'][1]} longer.")
    if shorter == ["A hint only"]:
        length.append(f"With {len(per_seed)} seeds, the SFT model's shorter FUSED answers are a hint, not a finding.")
    return ["\n".join(acc), "", "\n".join(length)]


def render(data: dict, out_dir: Path, figure_too: bool = True) -> Path:
    """``out_dir/sft.{md,json}`` (and the figure) from the recorded ``data``: args, rows, per_seed, provenance."""
    from fbt_megatron.research.report import answers_table, figure, fmt, provenance_line, save, table

    a, rows = data["args"], data["rows"]
    f = lambda ms, d=3: fmt(ms[0], ms[1], d)  # noqa: E731
    md = "\n".join([
        "# Instruction tuning at small scale", "",
        answers_table(answers(data), number=f"number ({len(data['per_seed'])} seeds)"), "",
        f"Seeds {a['seeds']}; tiny recipe pretrained {a['pretrain_steps']} steps (FBT: feedback from step "
        f"{int(0.6 * a['pretrain_steps'])}), SFT {a['sft_steps']} steps on the embedded math problems as conversations "
        f"(loss on the assistant turn), FBT with the 75/22/3 mix from step 0; the standard model (fusion off) "
        f"gets the same compute (steps x FBT's mean passes per step). {a['problems']} held-out problems, greedy, at "
        f"most {a['max_new_tokens']} new tokens; base models prompted `Question: q\\nAnswer:`, SFT models through the "
        "chat template. Mean ± standard deviation over seeds.", "",
        table(["model", "decoding", "exact match", "median generated tokens", "mean generated tokens",
               "paired diff vs standard (tokens)", "shorter / longer (all seeds)"],
              [[r["model"], r["mode"], f(r["exact_match"]), f(r["median_tokens"], 1), f(r["mean_tokens"], 1),
                f(r["paired_mean_diff"], 2) if "paired_mean_diff" in r else "–",
                " / ".join(map(str, r["paired_shorter_longer"])) if "paired_shorter_longer" in r else "–"] for r in rows]),
        "", "![SFT](sft.png)", "", *findings(data), "",
        provenance_line(data["provenance"])])
    return save(out_dir, "sft", md, data, draw=(lambda: _figure(rows, figure)) if figure_too else None)


def _figure(rows: list[dict], figure):
    fig, (ax1, ax2) = figure(2, width=5.5)
    labels = [f"{r['model']}\n{r['mode']}" for r in rows]
    colors = {"standard": "0.6", "feedback": "C0", "fused": "C1"}
    x = range(len(rows))
    ax1.bar(x, [r["exact_match"][0] for r in rows], yerr=[r["exact_match"][1] for r in rows], capsize=3,
            color=[colors[r["mode"]] for r in rows])
    ax1.set_ylabel("exact match (held-out math)")
    ax2.bar(x, [r["median_tokens"][0] for r in rows], yerr=[r["median_tokens"][1] for r in rows], capsize=3,
            color=[colors[r["mode"]] for r in rows])
    ax2.set_ylabel("median generated tokens")
    for ax in (ax1, ax2):
        ax.set_xticks(list(x), labels, rotation=60, fontsize=7)
    return fig


# the arguments of ``run`` that change the numbers (the rest: where files go)
RESULT_ARGS = ("seeds", "pretrain_steps", "sft_steps", "problems", "max_new_tokens", "max_tokens")


def run_command(a) -> str:
    """The ``run`` command line that reproduces ``a``'s results (every argument of RESULT_ARGS)."""
    return "python tools/sft_math.py run " + " ".join(f"--{k.replace('_', '-')} {getattr(a, k)}" for k in RESULT_ARGS)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("conversations", help="write the embedded math problems as chat JSONL")
    c.add_argument("--out", default="data/math_chat.jsonl")
    c.add_argument("--docs", type=int, default=20_000, help="math documents (1-4 problems each)")
    r = sub.add_parser("run", help="the experiment (see above)")
    r.add_argument("--seeds", default="1,2,3")
    r.add_argument("--pretrain-steps", type=int, default=300)
    r.add_argument("--sft-steps", type=int, default=150)
    r.add_argument("--problems", type=int, default=100)
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--max-tokens", type=int, default=128, help="chat: longest conversation (the recipe's seq_length)")
    r.add_argument("--work", default="runs/sft_math")
    r.add_argument("--out", default="docs/results")
    r.add_argument("--force", action="store_true", help="train again runs that already finished")
    # not among ``run``'s recorded args (SUPPRESS: absent unless given)
    r.add_argument("--render-only", action="store_true", default=argparse.SUPPRESS,
                   help="write the page again from --out's recorded JSON")
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.cmd == "run" and getattr(a, "render_only", False):
        from fbt_megatron.research.report import render_again

        print(render_again(render, Path(a.out), "sft").read_text())
        return 0
    os.environ.setdefault("FBT_DEVICE", "cpu")
    if a.cmd == "conversations":
        from fbt_megatron.research.sft import write_conversations

        print(f"{write_conversations(a.out, a.docs)} conversations -> {a.out}")
        return 0
    from data_pipeline.embedded import build_embedded
    from fbt_megatron.research.report import check_report_files, provenance_record
    from fbt_megatron.research.sft import held_out_problems

    out = ROOT / a.out  # relative paths name places in the repository (the runs chdir there)
    check_report_files(out, "sft")  # before the runs, not after them

    t0 = time.perf_counter()
    os.chdir(ROOT)  # the recipes name data/embedded relative to the repository
    build_embedded("data/embedded", seq_length=128, progress=False, log=lambda m: print(f"[data] {m}", flush=True))
    work = Path(a.work).resolve()
    chat_dir = prepare_chat(work, "data/embedded/tokenizer.model", a.max_tokens)
    problems = held_out_problems(a.problems)
    per_seed = []
    for seed in [int(s) for s in a.seeds.split(",")]:
        dirs = runs_for_seed(seed, a, work, chat_dir)
        per_seed.append(measure_all(dirs, problems, a))
    data = {"args": vars(a), "rows": summarise(per_seed), "per_seed": per_seed,
            "provenance": provenance_record(run_command(a), time.perf_counter() - t0)}
    print(render(data, out).read_text())
    return 0


if __name__ == "__main__":
    from fbt_megatron.research.report import run_tool

    sys.exit(run_tool(main, "sft_math"))
