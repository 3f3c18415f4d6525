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

from data_pipeline.argtypes import positive_int


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


def pass_counts(text: str) -> list[int]:
    """``--passes``: comma-separated pass counts, each an integer >= 1."""
    try:
        return [positive_int(k.strip()) for k in text.split(",")]
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: each pass count {err}") from None


def check_json_out(path: Path) -> None:
    """``--json PATH`` may replace only an earlier report of this tool: a user's file there is refused."""
    from data_pipeline.output_dir import json_object_with
    from fbt_megatron.errors import UserError

    if path.is_dir():
        raise UserError(f"--json {path} is a directory: give a file name")
    if not path.parent.is_dir():
        raise UserError(f"--json {path}: the folder {path.parent} does not exist")
    if path.exists():
        try:
            ours = json_object_with("checkpoint", "seq_length", "rows")(path)
        except (OSError, UnicodeDecodeError, ValueError):
            ours = False
        if not ours:
            raise UserError(f"--json {path} exists and is not a report of this tool: nothing was changed; "
                            "choose another file, or move it away")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--passes", type=pass_counts, default="1,2,3,5,10,30,100",
                    help="comma-separated pass counts, each >= 1 (default 1,2,3,5,10,30,100)")
    ap.add_argument("--json", type=Path, default=None, help="also write the report here (replaces only its own)")
    a = ap.parse_args(argv)
    if a.json is not None:
        check_json_out(a.json)  # before the model is loaded
    os.environ.setdefault("FBT_DEVICE", "cpu")
    from fbt_megatron import runtime

    runtime.init_distributed()
    try:
        report = depth_report(a.run_dir, a.passes)
    finally:
        runtime.shutdown()
    print(f"{report['checkpoint']} (sequence length {report['seq_length']})")
    print(f"{'passes':>6}  {'val loss':>9}  {'last residual':>13}")
    for r in report["rows"]:
        res = "-" if r["last_residual"] is None else f"{r['last_residual']:.2e}"
        print(f"{r['passes']:>6}  {r['val_loss']:9.4f}  {res:>13}{'  converged' if r['converged'] else ''}")
    if a.json is not None:
        from fbt_megatron.files import write_text_atomic

        write_text_atomic(a.json, json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    from fbt_megatron.research.report import run_tool

    sys.exit(run_tool(main, "feedback_depth"))
