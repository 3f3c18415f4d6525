"""The switch: how the fusion's initialisation decides how fast the fed-back mode is learned.

    python tools/switch_init.py [--seed 1] [--steps 600] [--out docs/results]

Pass 1 is the ordinary transformer, so W_U and W_G get their first gradient at the switch to
multi-pass batches (the tiny recipe: step 360 of 600); the fusion's initialisation is what the fed-back
mode starts from there. This trains the tiny recipe once per fusion initialisation (same seed, same
data: the runs are identical up to the switch) and records the held-out validation loss with 1 and
with 3 passes every 50 steps after it. Writes docs/results/switch_init.{md,json}; ``--render-only``
writes the page again from the recorded JSON (the page's answers are computed from its numbers).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


EVERY = 50
VARIANTS = {  # name -> recipe overrides (feedback.*); the first is the baseline the others are read against
    "normal W_U (depth-scaled), normal W_G": ["feedback.value_init=normal", "feedback.gate_init=normal"],
    "identity W_U, normal W_G": ["feedback.value_init=identity", "feedback.gate_init=normal"],
    "normal W_U, unit-spread W_G": ["feedback.value_init=normal", "feedback.gate_init=unit_spread"],
    "identity W_U, unit-spread W_G": ["feedback.value_init=identity", "feedback.gate_init=unit_spread"],
}
ONE_PASS_TOLERANCE = 0.02  # a 1-pass loss difference at the last step up to this counts as no change
WINNER_MARGIN = 0.02  # a 3-pass loss lead at the last step up to this names no winner


def switch_step(steps: int) -> int:
    return 360 * steps // 600


def _label(name: str) -> str:
    """'identity W_U, unit-spread W_G' -> 'Identity W_U with a unit-spread W_G'."""
    text = name.replace(", ", " with a ", 1)
    return text[:1].upper() + text[1:]


def answers(data: dict) -> list[list[str]]:
    """The page's opening rows, from the recorded losses at the last step: the initialisation with the lowest
    3-pass loss when it leads by more than WINNER_MARGIN, against the baseline (the first of VARIANTS; the
    runner-up when the baseline is lowest or was not run), and whether that choice moves the 1-pass loss by more
    than ONE_PASS_TOLERANCE."""
    history = data["val_history"]
    names, baseline = list(history), next(iter(VARIANTS))
    last = min(max(v["step"] for v in h) for h in history.values())
    loss = {n: next(v["loss"] for v in h if v["step"] == last) for n, h in history.items()}
    best = min(names, key=lambda n: loss[n]["3"])
    other = baseline if baseline in names and best != baseline else \
        min((n for n in names if n != best), key=lambda n: loss[n]["3"], default=best)
    lead = loss[other]["3"] - loss[best]["3"]
    seeds = "one seed"  # the tool trains one seed per variant
    one_pass = loss[best]["1"] - loss[other]["1"]
    changes = abs(one_pass) > ONE_PASS_TOLERANCE
    return [
        ["Which fusion initialisation should the switch use?",
         (_label(best) + (" (the baseline)" if best == baseline else "")) if lead > WINNER_MARGIN
         else f"No clear winner (the lowest leads by {WINNER_MARGIN} or less)",
         f"3-pass loss at step {last}: {loss[best]['3']:.3f} against {loss[other]['3']:.3f} ({seeds})", "more seeds"],
        ["Does it change the 1-pass mode?",
         ("Yes, its 1-pass loss is higher" if one_pass > 0 else "Yes, its 1-pass loss is lower") if changes else "No",
         f"1-pass loss {loss[best]['1']:.3f} against {loss[other]['1']:.3f} (difference "
         f"{'over' if changes else 'within'} {ONE_PASS_TOLERANCE})",
         "more seeds" if changes else "–"],
    ]


def render(data: dict, out_dir: Path, figure_too: bool = True) -> Path:
    """``out_dir/switch_init.{md,json}`` from the recorded ``data``: args, val_history, provenance (no figure)."""
    from fbt_megatron.research.report import answers_table, provenance_line, save, table

    args, results = data["args"], data["val_history"]
    start = switch_step(args["steps"])
    steps = [v["step"] for v in next(iter(results.values())) if v["step"] >= start]
    rows = []
    for name, history in results.items():
        by_step = {v["step"]: v["loss"] for v in history}
        rows.append([name] + [f"{by_step[st]['1']:.3f} / {by_step[st]['3']:.3f}" for st in steps])
    md = "\n".join([
        "# The switch: fusion initialisation", "", answers_table(answers(data)), "",
        f"Tiny recipe, seed {args['seed']}, {args['steps']} steps, multi-pass batches (75/22/3) from step {start}. "
        "Held-out validation loss with **1 pass / 3 passes** after the switch (the runs are identical before it: "
        "pass 1 does not use the fusion).", "",
        table(["W_U, W_G initialisation"] + [f"step {st}" for st in steps], rows), "",
        provenance_line(data["provenance"])])
    return save(out_dir, "switch_init", md, data)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--variants", default=",".join(str(i) for i in range(len(VARIANTS))),
                    help="indices into the variant list (default: all)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (each with one CPU thread when > 1)")
    ap.add_argument("--runs", default="runs/research/switch_init")
    ap.add_argument("--reuse", action="store_true",
                    help="use finished runs found under --runs instead of retraining; continue stopped ones "
                         "from their checkpoints")
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--render-only", action="store_true", help="write the page again from --out's recorded JSON")
    a = ap.parse_args(argv)
    from fbt_megatron.research.report import check_report_files, provenance_record, render_again

    if a.render_only:
        print(render_again(render, Path(a.out), "switch_init").read_text())
        return 0
    check_report_files(Path(a.out), "switch_init")  # before the runs, not after them
    from fbt_megatron.research.runs import finished_run, run_jobs, train_run

    os.environ.setdefault("FBT_DEVICE", "cpu")
    names = [list(VARIANTS)[int(i)] for i in a.variants.split(",")]
    start = switch_step(a.steps)
    t0 = time.perf_counter()

    def one(i, name):
        done = finished_run(Path(a.runs) / f"variant{i}") if a.reuse else None
        if done is not None:  # a finished run of this variant (same arguments): render it again
            return done["val_history"]
        print(f"[switch_init] {name}", flush=True)
        s = train_run("recipes/tiny.yaml", Path(a.runs) / f"variant{i}",
                      [f"name=switch_{i}", f"seed={a.seed}", f"schedule.seed={a.seed}", f"train.steps={a.steps}",
                       f"schedule.feedback_start_step={start}", "eval.feedback_passes=3", f"eval.every={EVERY}",
                       "checkpoint.every=100000", "checkpoint.at_end=false", "logging.tensorboard=false",
                       *VARIANTS[name]], resume=a.reuse)  # a stopped run continues from its checkpoint
        return s["val_history"]

    indices = [list(VARIANTS).index(n) for n in names]
    results = dict(zip(names, run_jobs(one, list(zip(indices, names)), a.jobs)))
    conditions = " ".join(filter(None, [
        f"Trained with `--jobs {a.jobs}` ({a.jobs} runs at a time, one CPU thread each)." if a.jobs > 1 else "",
        "`--reuse` rendered finished runs again without retraining (the time below excludes them)." if a.reuse
        else ""]))
    data = {"args": vars(a), "val_history": results,
            "provenance": provenance_record("python tools/switch_init.py" + (" --reuse" if a.reuse else ""),
                                            time.perf_counter() - t0, conditions)}
    print(render(data, Path(a.out)).read_text())
    return 0


if __name__ == "__main__":
    from fbt_megatron.research.report import run_tool

    sys.exit(run_tool(main, "switch_init"))
