"""Feedback depth probe: validation loss and Jacobi residual of a checkpoint at growing pass counts.

    python tools/feedback_depth.py RUN_DIR [--passes 1,2,3,5,10,30,100] [--json out.json]

Loads ``RUN_DIR/checkpoints/latest`` (any layout it was saved under), runs the held-out validation
batches of the run's own recipe with k passes of teacher forcing and prints, per k, the token-mean
loss and the last pass's relative residual ||h^k - h^{k-1}|| / ||h^{k-1}||. A map that has become a
contraction shows residuals shrinking towards 0 and a loss that stays flat as k grows (DEQ's
convention calls < 0.05 converged); a diverging one shows both growing. Once k exceeds the sequence
length the iteration has reached the exact recurrence, so the residual must be ~0 whatever the weights.
Runs on one process (TP=1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


CONVERGED = 0.05


def depth_report(run_dir: str | Path, passes: list[int]) -> dict:
    """Evaluate the latest checkpoint of ``run_dir`` at each pass count (call inside a process group)."""
    from fbt_megatron import runtime
    from fbt_megatron.checkpoint.model import load_checkpoint_model
    from fbt_megatron.data.loaders import build_valid_batches
    from fbt_megatron.parallel.runner import get_runner
    from fbt_megatron.train.train_step import evaluate

    model, recipe, latest = load_checkpoint_model(run_dir)
    batches = build_valid_batches(recipe, 0, 1)
    runner = get_runner(model)
    rows = []
    for k in passes:
        ev = evaluate(runner, batches, k, runtime.device())
        rows.append({"passes": k, "val_loss": ev.loss, "last_residual": ev.last_residual,
                     "converged": ev.last_residual is not None and ev.last_residual < CONVERGED})
    return {"checkpoint": str(latest), "seq_length": recipe.data.seq_length, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--passes", default="1,2,3,5,10,30,100")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("FBT_DEVICE", "cpu")
    from fbt_megatron import runtime

    runtime.init_distributed()
    try:
        report = depth_report(a.run_dir, [int(k) for k in a.passes.split(",")])
    finally:
        runtime.shutdown()
    print(f"{report['checkpoint']} (sequence length {report['seq_length']})")
    print(f"{'passes':>6}  {'val loss':>9}  {'last residual':>13}")
    for r in report["rows"]:
        res = "-" if r["last_residual"] is None else f"{r['last_residual']:.2e}"
        print(f"{r['passes']:>6}  {r['val_loss']:9.4f}  {res:>13}{'  converged' if r['converged'] else ''}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
