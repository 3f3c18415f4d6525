"""The switch: how the fusion's initialisation decides how fast the fed-back mode is learned.

    python tools/switch_init.py [--seed 1] [--steps 600] [--out docs/results]

Pass 1 is the ordinary transformer, so W_U and W_G get their first gradient at the switch to
multi-pass batches (the tiny recipe: step 360 of 600). This trains the tiny recipe once per fusion
initialisation (same seed, same data: the runs are identical up to the switch) and records the
held-out validation loss with 1 and with 3 passes every 50 steps after it. Writes
docs/results/switch_init.{md,json}. Budget: about 4 minutes per variant on 2 idle CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


EVERY = 50
VARIANTS = {  # name -> recipe overrides (feedback.*)
    "normal W_U (depth-scaled), normal W_G": ["feedback.value_init=normal", "feedback.gate_init=normal"],
    "identity W_U, normal W_G": ["feedback.value_init=identity", "feedback.gate_init=normal"],
    "normal W_U, unit-spread W_G": ["feedback.value_init=normal", "feedback.gate_init=unit_spread"],
    "identity W_U, unit-spread W_G": ["feedback.value_init=identity", "feedback.gate_init=unit_spread"],
}


def main(argv=None) -> int:
    from fbt_megatron.research.report import provenance, save, table
    from fbt_megatron.research.runs import run_jobs, train_run

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--variants", default=",".join(str(i) for i in range(len(VARIANTS))),
                    help="indices into the variant list (default: all)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (each with one CPU thread when > 1)")
    ap.add_argument("--runs", default="runs/research/switch_init")
    ap.add_argument("--reuse", action="store_true", help="use finished runs found under --runs instead of retraining")
    ap.add_argument("--out", default="docs/results")
    a = ap.parse_args(argv)
    os.environ.setdefault("FBT_DEVICE", "cpu")
    names = [list(VARIANTS)[int(i)] for i in a.variants.split(",")]
    start = 360 * a.steps // 600
    t0 = time.perf_counter()

    def one(i, name):
        done = Path(a.runs) / f"variant{i}" / "summary.json"
        if a.reuse and done.is_file():  # a finished run of this variant (same arguments): render it again
            return json.loads(done.read_text())["val_history"]
        print(f"[switch_init] {name}", flush=True)
        s = train_run("recipes/tiny.yaml", Path(a.runs) / f"variant{i}",
                      [f"name=switch_{i}", f"seed={a.seed}", f"schedule.seed={a.seed}", f"train.steps={a.steps}",
                       f"schedule.feedback_start_step={start}", "eval.feedback_passes=3", f"eval.every={EVERY}",
                       "checkpoint.every=100000", "checkpoint.at_end=false", "logging.tensorboard=false",
                       *VARIANTS[name]])
        return s["val_history"]

    indices = [list(VARIANTS).index(n) for n in names]
    results = dict(zip(names, run_jobs(one, list(zip(indices, names)), a.jobs)))
    steps = [v["step"] for v in next(iter(results.values())) if v["step"] >= start]
    rows = []
    for name, history in results.items():
        by_step = {v["step"]: v["loss"] for v in history}
        rows.append([name] + [f"{by_step[st]['1']:.3f} / {by_step[st]['3']:.3f}" for st in steps])
    md = "\n".join([
        "# The switch: fusion initialisation", "",
        f"Tiny recipe, seed {a.seed}, {a.steps} steps, multi-pass batches (75/22/3) from step {start}. Held-out "
        "validation loss with **1 pass / 3 passes** after the switch (the runs are identical before it: pass 1 "
        "does not use the fusion).", "",
        table(["W_U, W_G initialisation"] + [f"step {st}" for st in steps], rows), "",
        "Trained with `--jobs 2` (two runs at a time, one CPU thread each) on a machine shared with other work; "
        "`--reuse` renders finished runs again without retraining (the time below then excludes them)." if a.reuse
        else "",
        provenance("python tools/switch_init.py" + (" --reuse" if a.reuse else ""), time.perf_counter() - t0)])
    print(save(Path(a.out), "switch_init", md, {"args": vars(a), "val_history": results}).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
