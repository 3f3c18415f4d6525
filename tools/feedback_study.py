"""The feedback study: does the fed-back mode learn more from the same tokens, given steps?

    python tools/feedback_study.py [--seeds 1,2] [--scale tiny|medium] [--groups main,compute,stabilisers,state]
                                   [--steps N] [--lr LR] [--fbt-recipe base|loss_mean|switch50] [--jobs 2]
                                   [--reuse] [--out docs/results]

Trains, from ``recipes/research/tiny_feedback.yaml`` (WSD LR, the switch to multi-pass batches on the
plateau at 20 % of the steps, validation at 1, 2 and 3 passes every 100 steps), per seed:

- ``main``: a standard model (``feedback.fusion=off``), FBT with the paper's 75/22/3 mix and FBT with the
  feedback-heavy 50/40/10 mix, on the same data in the same order (equal tokens);
- ``compute``: the standard model given each FBT run's FLOPs (more steps, same WSD shape);
- ``stabilisers``: the 50/40/10 run with one stabiliser changed each (see ``ABLATIONS``; with ``--lr`` also
  ``LR_VARIANT_ABLATIONS``), and the standard model with the same change where the change is to the model
  itself (``MODEL_ABLATIONS``: untied embeddings);
- ``state``: a state-tracking task (running products in the symmetric group S3, one element per token,
  sequences of 32 steps, far past the 4 layers) for a standard model and FBT;
- ``recipe`` (E1): the untied standard model, the best FBT configuration (untied, fusion LR x10, 50/40/10)
  and that configuration with ``feedback.loss_on=mean``, and with the switch at 50 % of the steps;
- ``form`` (E2): the untied standard model, that FBT configuration with the GLU fusion and with the additive
  one (``feedback.fusion=additive``), and the state task for each of the three (``state_standard_untied``,
  ``state_fbt_heavy_untied_fusion_lr_x10``, ``state_fbt_heavy_untied_fusion_lr_x10_additive``, each FBT
  state run compared with the untied standard one);
- ``budget`` (E3, the token multiplier): the untied standard model at 0.5x, 1x and 2x the steps (each its own
  full schedule) and the FBT configuration at 1x and 2x. The 1x runs are E1's (``standard_untied``,
  ``fbt_heavy_untied_fusion_lr_x10``); the others carry their steps after ``untied``
  (``standard_untied_steps600``, ``fbt_heavy_untied_steps2400_fusion_lr_x10`` at 1200 steps), so the report
  pairs each FBT run with the standard run of its own steps.

``--fbt-recipe loss_mean|switch50`` gives the FBT runs of ``form`` and ``budget`` that E1 recipe change; their
names end in it (``fbt_heavy_untied_fusion_lr_x10_additive_loss_mean``), so runs of two recipes never stand
in for each other under ``--reuse``.

Each seed sets the model's initialisation and its own data order (``data.seed``), the same for every run of
the seed, and every run validates on 512 held-out sequences (drawn with its data seed) every 200 steps for
its curve; the report and runs folder get ``_orders``. ``--shared-data-order`` keeps the earlier studies'
protocol (every seed on data seed 0, 64 validation sequences every 100 steps, read out on them too) to
rebuild or continue their reports.

Then reads each finished run out (cached in ``RUN/readouts.json``) on one validation set for every run and
seed: the held-out documents of each source read whole, the sources weighted as in the mix (the state task: the
validation sequences of data seed 0); validation loss at 1, 2, 3 passes
and at the exact recurrence (passes = sequence length), answer NLL and exact match on held-out
arithmetic under standard decoding and feedback decoding after a 1-pass, a FUSED 2-pass and the exact
prefill, the fusion's gate saturation and W_U's distance from
its initialisation at every kept checkpoint; for the state task, accuracy per number of composed
steps under 1 pass and the exact recurrence. Paired differences (k-pass - 1-pass, FBT - standard) are
reported as mean ± standard error over seeds with the paired t-test's 95 % interval (df = seeds - 1). Writes docs/results/feedback_study_SCALE[_STEPS][_lrLR].{md,json,png};
with ``--reuse`` an unfinished run continues from its latest checkpoint, and a run recorded there stands
in for its run folder when that is gone; a report keeps the runs recorded in the one it replaces, also
those it does not select, so the study can be continued run by run (``--only``, ``--seeds``) across
machines. docs/results/feedback_phase.md is the write-up.

A run's CPU time grows with ``--steps`` and ``--scale`` (the hours per group are in
docs/results/benchmarks.md). A run folder lasts only as long as its machine; a finished run lasts in the
report's JSON, so on machines that do not keep files start a run only where it can finish. One study at a
time, ``--jobs`` at most the cores: more training processes than cores thrash.
``--smoke`` trains each selected run for a few steps at a toy size (the tests use it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


RECIPE = "recipes/research/tiny_feedback.yaml"
MIX_PAPER, MIX_HEAVY = [0.75, 0.22, 0.03], [0.5, 0.4, 0.1]
SCALES = {"tiny": [], "medium": ["model.num_layers=8", "model.hidden_size=384", "model.num_attention_heads=6"]}
SMOKE = ["train.steps=12", "schedule.feedback_start_step=4", "eval.every=6", "checkpoint.every=4",
         "data.valid_sequences=8"]
# One stabiliser changed at a time, from the feedback-heavy run (the one whose fed-back mode trains most).
ABLATIONS = {
    "no_mixin": ["feedback.prefix_mixin=0.0"],
    "bounded_mixin": ["feedback.mixin=bounded"],
    "no_jitter": ["feedback.jitter_std=0.0"],
    "untied": ["model.tie_embeddings=false"],
    "fusion_lr_x10": ["optimizer.fusion_lr_multiplier=10.0"],
    "fusion_lr_x30": ["optimizer.fusion_lr_multiplier=30.0"],
    "additive": ["feedback.fusion=additive"],
    # the two changes that each closed part of the gap, together (compared with ``standard_untied``)
    "untied_fusion_lr_x10": ["model.tie_embeddings=false", "optimizer.fusion_lr_multiplier=10.0"],
}
# Stabiliser runs planned only with --lr: the fusion's LR is the multiplier times the peak LR, so at the
# medium size's 6e-4 ×50, and at the tiny size's 1e-3 ×30, give the ×10 runs' 3e-2 at the recipe's 3e-3
# (at 3e-3 itself they would be 0.15 and 0.09).
LR_VARIANT_ABLATIONS = {
    "untied_fusion_lr_x30": ["model.tie_embeddings=false", "optimizer.fusion_lr_multiplier=30.0"],
    "untied_fusion_lr_x50": ["model.tie_embeddings=false", "optimizer.fusion_lr_multiplier=50.0"],
}
MODEL_ABLATIONS = {"untied"}  # ablations that change the model itself, not only its fusion
# E1, recipe against mechanism: the best FBT configuration (untied, fusion LR x10) with one change to the
# training recipe each, beside the same configuration unchanged and the untied standard model.
RECIPE_BASE = "fbt_heavy_untied_fusion_lr_x10"
RECIPE_VARIANTS = {"loss_mean": lambda steps: ["feedback.loss_on=mean"],
                   "switch50": lambda steps: [f"schedule.feedback_start_step={steps // 2}"]}
# Every seed's own data order (data.seed = the seed, the same for all runs of a seed, so pairs stay
# paired), validated on 512 held-out sequences (65,536 tokens), every 200 steps to keep validation's
# cost near a fifth of training's. --shared-data-order keeps the earlier studies' protocol: every seed
# on data seed 0, 64 validation sequences every 100 steps.
SEED_ORDER = ["data.valid_sequences=512", "eval.every=200"]
GROUPS = ("main", "compute", "stabilisers", "state", "recipe", "form", "budget")
# The loss rule of every FBT run that names none: the research recipe's default before E1 (issue 59) made it
# `loss_on: mean`, kept so that each run's name still means what it meant (``*_loss_mean``: every pass).
LOSS_RULE = "feedback.loss_on=last"
FBT_RECIPES = ("base", *RECIPE_VARIANTS)  # --fbt-recipe: the E1 recipe of the form and budget groups' FBT runs
STATE_TASK = ["data.source=synthetic", "data.synthetic.task=state_tracking", "data.synthetic.group=symmetric",
              "data.synthetic.group_size=3", "data.synthetic.vocab_size=6", "data.seq_length=32",
              "model.vocab_size=6", "model.max_sequence_length=32", "batch.global_batch_size=32",
              "batch.micro_batch_size=16", "data.valid_sequences=256"]


def recipe_steps(overrides: list[str]) -> tuple[int, int]:
    """(train.steps, schedule.feedback_start_step) of the research recipe under ``overrides``."""
    import yaml

    from fbt_megatron.research.runs import ROOT

    base = yaml.safe_load((ROOT / RECIPE).read_text())
    steps, start = base["train"]["steps"], base["schedule"]["feedback_start_step"]
    for o in overrides:
        key, _, value = o.partition("=")
        if key == "train.steps":
            steps = int(value)
        elif key == "schedule.feedback_start_step":
            start = int(value)
    return steps, start


def compute_factor(steps: int, start: int, mix: list[float]) -> float:
    """An FBT run's training FLOPs over a standard run's of the same steps (a k-pass step costs k 1-pass
    steps with grad_mode all; the fusion's own FLOPs, 2 D^2 a token, are left out)."""
    expected = sum((i + 1) * p for i, p in enumerate(mix))
    return (start + (steps - start) * expected) / steps


def mix_arg(mix: list[float]) -> str:
    return "schedule.mix=[" + ",".join(str(p) for p in mix) + "]"


def schedule_for(steps: int, overrides: list[str] = ()) -> list[str]:
    """``overrides`` made a run of ``steps`` steps with its own full schedule: the switch at 20 % of the steps,
    a checkpoint every 20 % (their earlier values dropped)."""
    schedule = [f"train.steps={steps}", f"schedule.feedback_start_step={steps // 5}", f"checkpoint.every={steps // 5}"]
    keys = {o.partition("=")[0] for o in schedule}
    return [o for o in overrides if o.partition("=")[0] not in keys] + schedule


def recipe_fbt(base: list[str], steps: int, recipe: str = "base", extra: list[str] = ()) -> tuple[str, list[str]]:
    """(name suffix, overrides) of E1's FBT configuration (untied, fusion LR x10, 50/40/10) on ``base`` (a run
    of ``steps`` steps), with ``extra`` (a change of the model, e.g. the additive fusion) and the recipe change
    ``recipe`` (:data:`RECIPE_VARIANTS`; "base": none), which the name ends in."""
    change = [] if recipe == "base" else RECIPE_VARIANTS[recipe](steps)
    return ("" if recipe == "base" else f"_{recipe}",
            base + [mix_arg(MIX_HEAVY)] + ABLATIONS["untied_fusion_lr_x10"] + list(extra) + change)


def plan(groups: list[str], scale: str, smoke: bool, steps: int | None = None,
         lr: float | None = None, shared_order: bool = False, fbt_recipe: str = "base") -> dict[str, list[str]]:
    """Run name -> ``fbt train`` overrides of the research recipe (seed added per run by
    :func:`run_overrides`). ``steps``: a shorter or longer run, the switch kept at 20 % of it; ``lr``:
    every run's peak learning rate; ``shared_order``: the earlier studies' validation (see ``SEED_ORDER``);
    ``fbt_recipe``: the E1 recipe change of the ``form`` and ``budget`` groups' FBT runs (``FBT_RECIPES``)."""
    if fbt_recipe not in FBT_RECIPES:
        raise ValueError(f"fbt_recipe: {fbt_recipe!r} is none of {FBT_RECIPES}")
    base = SCALES[scale] + ([] if shared_order else SEED_ORDER) + (SMOKE if smoke else [])
    if steps:
        base += [f"train.steps={steps}", f"schedule.feedback_start_step={steps // 5}", f"checkpoint.every={steps // 5}"]
    if lr:
        base += [f"optimizer.lr={lr:g}"]
    steps, start = recipe_steps(base)
    runs: dict[str, list[str]] = {}
    if "main" in groups:
        runs["standard"] = base + ["feedback.fusion=off"]
        runs["fbt"] = base + [mix_arg(MIX_PAPER)]
        runs["fbt_heavy"] = base + [mix_arg(MIX_HEAVY)]
    if "compute" in groups:
        for name, mix in (("fbt", MIX_PAPER), ("fbt_heavy", MIX_HEAVY)):
            n = round(steps * compute_factor(steps, start, mix))
            runs[f"standard_compute_{name}"] = base + ["feedback.fusion=off", f"train.steps={n}"]
    if "stabilisers" in groups:
        for name, extra in {**ABLATIONS, **(LR_VARIANT_ABLATIONS if lr else {})}.items():
            runs[f"fbt_heavy_{name}"] = base + [mix_arg(MIX_HEAVY)] + extra
            if name in MODEL_ABLATIONS:  # the standard model with the same change: the fair baseline
                runs[f"standard_{name}"] = base + ["feedback.fusion=off"] + extra
    state = base + STATE_TASK + (["data.valid_sequences=8"] if smoke else [])
    if "recipe" in groups:  # E1; the state task for the standard model, the unchanged recipe and loss_on mean
        for prefix, at, recipes in (("", base, FBT_RECIPES), ("state_", state, ("base", "loss_mean"))):
            runs[f"{prefix}standard_untied"] = at + ["feedback.fusion=off"] + ABLATIONS["untied"]
            for name in recipes:
                suffix, fbt = recipe_fbt(at, steps, name)
                runs[f"{prefix}{RECIPE_BASE}{suffix}"] = fbt
    if "state" in groups:
        runs["state_standard"] = state + ["feedback.fusion=off"]
        runs["state_fbt_heavy"] = state + [mix_arg(MIX_HEAVY)]
    if "form" in groups:  # E2: the fusion's form, GLU against additive, on language and on the state task
        untied = ABLATIONS["untied"]
        for prefix, at in (("", base), ("state_", state)):
            runs[f"{prefix}standard_untied"] = at + ["feedback.fusion=off"] + untied
            suffix, glu = recipe_fbt(at, steps, fbt_recipe)
            _, additive = recipe_fbt(at, steps, fbt_recipe, ABLATIONS["additive"])
            runs[f"{prefix}{RECIPE_BASE}{suffix}"] = glu
            runs[f"{prefix}{RECIPE_BASE}_additive{suffix}"] = additive
    if "budget" in groups:  # E3: the standard model at 0.5x, 1x, 2x the steps, FBT at 1x and 2x
        for n in (steps // 2, steps, 2 * steps):
            at, tag = (base, "") if n == steps else (schedule_for(n, base), f"_steps{n}")  # 1x: E1's runs
            runs[f"standard_untied{tag}"] = at + ["feedback.fusion=off"] + ABLATIONS["untied"]
            if n >= steps:  # at 1x RECIPE_BASE; the steps follow "untied", so that the report pairs
                # fbt_heavy_untied_stepsN_fusion_lr_x10 with standard_untied_stepsN (study.same_change_baseline)
                suffix, fbt = recipe_fbt(at, n, fbt_recipe)
                runs[f"fbt_heavy_untied{tag}_fusion_lr_x10{suffix}"] = fbt
    return {name: pin_loss_rule(overrides) for name, overrides in runs.items()}


def pin_loss_rule(overrides: list[str]) -> list[str]:
    """An FBT run's ``overrides`` with :data:`LOSS_RULE` where they set no loss rule (a standard run's as given)."""
    if "feedback.fusion=off" in overrides or any(o.startswith("feedback.loss_on=") for o in overrides):
        return overrides
    return overrides + [LOSS_RULE]


def run_overrides(runs: dict[str, list[str]], name: str, seed: int, shared_order: bool = False) -> list[str]:
    """The ``fbt train`` overrides of run ``name`` at ``seed``: the seed sets the model's initialisation and,
    unless ``shared_order``, the data order (``data.seed``), the same for every run of the seed."""
    return [f"name=study_{name}_{seed}", f"seed={seed}", *([] if shared_order else [f"data.seed={seed}"]), *runs[name]]


def study_name(scale: str, steps: int | None, lr: float | None, smoke: bool, shared_order: bool = True) -> str:
    """SCALE[_STEPS][_lrLR][_orders][_smoke]: the report's stem after ``feedback_study_`` and the default runs
    folder, so that a variant's runs and report never stand in for another's (``--reuse`` reads both);
    ``_orders``: a data order per seed (the earlier studies shared one)."""
    return (scale + (f"_{steps}" if steps else "") + (f"_lr{lr:g}" if lr else "")
            + ("" if shared_order else "_orders") + ("_smoke" if smoke else ""))


def add_layer_counts(readouts: dict, runs: dict[str, list[str]]) -> None:
    """Give each read-out ``NAME_seedS`` without ``num_layers`` (read out before read-outs carried it) its
    run's layer count, from the research recipe under the run's overrides (``runs[NAME]``)."""
    from fbt_megatron.recipe import load_recipe
    from fbt_megatron.research.runs import ROOT

    for name, readout in readouts.items():
        if "num_layers" not in readout:
            readout["num_layers"] = load_recipe(ROOT / RECIPE, runs[name.rpartition("_seed")[0]]).model.num_layers


def recorded_runs(report: Path) -> dict:
    """Runs recorded in an earlier report's JSON (``{run: {"val_history", "readouts"}}``): with ``--reuse``
    they stand in for run folders that are gone (a study spans sessions; the runs folder need not)."""
    if not report.is_file():
        return {}
    data = json.loads(report.read_text())
    return {name: {"val_history": data["val_history"][name], "readouts": data["readouts"][name]}
            for name in data.get("readouts", {}) if name in data.get("val_history", {})}


def recorded_divergences(report: Path) -> dict:
    """Runs an earlier report named as diverged (``{run: stop reason}``): a narrower report keeps them."""
    return json.loads(report.read_text()).get("diverged", {}) if report.is_file() else {}


def train(runs: dict[str, list[str]], seeds: list[int], root: Path, jobs: int, reuse: bool,
          recorded: dict | None = None, train_missing: bool = True, shared_order: bool = False) -> dict:
    """Train every (run, seed) not finished yet (``reuse``: a finished run folder, or a run in
    ``recorded``; an unfinished one continues from its latest checkpoint; a diverged one is not trained again)
    under ``root/NAME_seedS``; returns their summaries (``train_missing`` False: only the finished ones,
    nothing trained). Stopped and diverged runs are printed and left out."""
    from data_pipeline.embedded import build_embedded
    from fbt_megatron.research.runs import ROOT, RunDiverged, RunStopped, diverged_run, finished_run, run_jobs, train_run

    recorded = recorded or {}
    # Built once here: runs started together would each try to build it (the second one fails on its lock).
    build_embedded(ROOT / "data/embedded", seq_length=128, progress=False, log=lambda m: None)

    def one(name, seed):
        run_dir = root / f"{name}_seed{seed}"
        done = finished_run(run_dir) if reuse else None
        if done is not None:
            return done
        if reuse and f"{name}_seed{seed}" in recorded:
            return recorded[f"{name}_seed{seed}"]
        if not train_missing:
            return None
        if reuse and (reason := diverged_run(run_dir)):  # resumed, it would diverge again
            print(f"[feedback_study] {name} seed {seed} diverged before ({reason}); not trained again (delete "
                  f"{run_dir} to train it afresh)", flush=True)
            return None
        print(f"[feedback_study] {name} seed {seed}", flush=True)
        try:
            return train_run(RECIPE, run_dir, run_overrides(runs, name, seed, shared_order), resume=reuse)
        except (RunStopped, RunDiverged) as e:  # not read out (a diverged run is named in the report); the rest go on
            print(f"[feedback_study] {e}", flush=True)
            return None

    todo = [(name, seed) for seed in seeds for name in runs]
    return {f"{name}_seed{seed}": s for (name, seed), s in zip(todo, run_jobs(one, todo, jobs)) if s is not None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--scale", choices=sorted(SCALES), default="tiny")
    ap.add_argument("--groups", default="main,compute,stabilisers,state",
                    help="main, compute, stabilisers, state, recipe (E1: loss_on mean, the switch at 50 %%, the state task), "
                    "form (E2: additive against GLU, with the state task), budget (E3: the standard model at "
                    "0.5x, 1x, 2x the steps, FBT at 1x, 2x)")
    ap.add_argument("--fbt-recipe", choices=FBT_RECIPES, default="base",
                    help="the E1 recipe change of the form and budget groups' FBT runs (their names end in it)")
    ap.add_argument("--steps", type=int, default=None, help="train.steps of every run (default: the recipe's "
                    "3000), the switch at 20 %% of it; the report and the runs folder get _STEPS")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate of every run (default: the recipe's "
                    "3e-3); the report and the runs folder get _lrLR")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (each with one CPU thread when > 1)")
    ap.add_argument("--runs", default=None, help="default runs/research/feedback_study/SCALE[_STEPS][_lrLR][_smoke]")
    ap.add_argument("--reuse", action="store_true", help="summarise finished runs found under --runs, continue unfinished ones from their "
                    "latest checkpoint, train the rest")
    ap.add_argument("--train-only", action="store_true", help="train, do not read out or write the report")
    ap.add_argument("--summarise-only", action="store_true",
                    help="train nothing: report the runs already finished (implies --reuse)")
    ap.add_argument("--only", default=None, help="run names of the groups to train or summarise (comma-separated, "
                    "e.g. standard,fbt_heavy); default all")
    ap.add_argument("--shared-data-order", action="store_true",
                    help="the earlier studies' protocol (every seed on data seed 0, 64 validation sequences every "
                    "100 steps): to rebuild or continue their reports; without it each seed has its own data "
                    "order and the report and runs folder get _orders")
    ap.add_argument("--smoke", action="store_true", help="a few steps at a toy size (tests)")
    ap.add_argument("--out", default="docs/results")
    a = ap.parse_args(argv)
    os.environ.setdefault("FBT_DEVICE", "cpu")
    groups = [g for g in a.groups.split(",") if g]
    unknown = set(groups) - set(GROUPS)
    if unknown:
        ap.error(f"--groups: unknown {sorted(unknown)}; allowed: {', '.join(GROUPS)}")
    seeds = [int(s) for s in a.seeds.split(",")]
    name = study_name(a.scale, a.steps, a.lr, a.smoke, a.shared_data_order)
    root = Path(a.runs or f"runs/research/feedback_study/{name}").resolve()
    runs = plan(groups, a.scale, a.smoke, a.steps, a.lr, a.shared_data_order, a.fbt_recipe)
    if a.only:
        only = [n for n in a.only.split(",") if n]
        if set(only) - set(runs):
            ap.error(f"--only: {sorted(set(only) - set(runs))} not in the groups' runs {sorted(runs)}")
        runs = {n: runs[n] for n in only}
    stem = f"feedback_study_{name}"
    out_dir = Path(a.out).resolve()
    from fbt_megatron.research.report import check_report_files

    check_report_files(out_dir, stem)  # before the runs, not after them (and before its JSON is read)
    recorded = recorded_runs(out_dir / f"{stem}.json")
    t0 = time.perf_counter()
    summaries = train(runs, seeds, root, a.jobs, a.reuse or a.summarise_only, recorded,
                      train_missing=not a.summarise_only, shared_order=a.shared_data_order)
    from fbt_megatron.research.runs import ROOT, diverged_run, finished_run

    selected = [f"{n}_seed{s}" for s in seeds for n in runs]
    diverged = {**{run: reason for run, reason in recorded_divergences(out_dir / f"{stem}.json").items()
                   if run not in selected},
                **{run: reason for run in selected if run not in summaries and (reason := diverged_run(root / run))}}
    if a.train_only:
        print(f"[feedback_study] trained {len(summaries)} runs in {(time.perf_counter() - t0) / 60:.1f} min"
              + (f"; diverged: {', '.join(diverged)}" if diverged else ""))
        return 0
    from fbt_megatron import runtime
    from fbt_megatron.research.study import read_out, render

    os.chdir(ROOT)  # the runs were trained there: their recipes name data by paths relative to it
    runtime.init_distributed()
    validation = "recipe" if a.shared_data_order else "held_out"  # see study.VALIDATIONS
    try:
        # a recorded run whose folder is gone or holds a stopped run (its checkpoint is not the recorded model)
        readouts = {name: recorded[name]["readouts"] if name in recorded and finished_run(root / name) is None
                    else read_out(root / name, smoke=a.smoke, validation=validation) for name in summaries}
    finally:
        runtime.shutdown()
    add_layer_counts(readouts, runs)
    out = render(summaries, readouts, seeds, a, time.perf_counter() - t0, out_dir, stem, kept=recorded,
                 diverged=diverged)
    print(out.read_text())
    return 0


if __name__ == "__main__":
    from fbt_megatron.research.report import run_tool

    sys.exit(run_tool(main, "feedback_study"))
