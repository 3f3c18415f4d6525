"""tools/feedback_depth.py reads a checkpoint back and probes the pass-to-pass map."""

import pytest

from tests.support.distributed import run_distributed
from tests.support.training import tiny_recipe, train_fn
from tools.feedback_depth import depth_report


def test_depth_report_matches_trainer_and_reaches_the_recurrence(tmp_path):
    recipe = tiny_recipe(tmp_path / "run", train={"steps": 3}, checkpoint={"at_end": True}, eval={"at_end": True})
    trained = run_distributed(train_fn, 2, recipe)[0]  # saved at DP=2, probed on one process
    seq = recipe["data"]["seq_length"]
    report = run_distributed(depth_report, 1, str(tmp_path / "run"), [1, 3, seq + 1])[0]
    rows = {r["passes"]: r for r in report["rows"]}
    # The checkpoint round trip and the evaluation agree with the trainer's own validation.
    assert rows[1]["val_loss"] == pytest.approx(trained["val_loss_1pass"], abs=1e-6)
    assert rows[3]["val_loss"] == pytest.approx(trained["val_loss_3pass"], abs=1e-6)
    assert rows[1]["last_residual"] is None and rows[3]["last_residual"] > 1e-4
    # After `seq` passes every position is exact, so pass seq+1 changes nothing.
    assert rows[seq + 1]["last_residual"] < 1e-5 and rows[seq + 1]["converged"]


def test_depth_report_without_checkpoint_names_the_directory(tmp_path):
    with pytest.raises(Exception, match="has no published checkpoint"):
        run_distributed(depth_report, 1, str(tmp_path), [1])
