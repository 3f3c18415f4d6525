"""Running a finished recipe again (`make train` twice) trains nothing and reports on its checkpoint."""

from tests.support.distributed import run_distributed
from tests.support.training import tiny_recipe, train_fn


def test_rerun_of_finished_run_reports_validation_of_its_checkpoint(tmp_path):
    recipe = tiny_recipe(tmp_path / "run", train={"steps": 2}, checkpoint={"at_end": True},
                         eval={"at_end": True})
    first = run_distributed(train_fn, 1, recipe)[0]
    again = run_distributed(train_fn, 1, recipe)[0]
    assert again["history"] == [] and again["step"] == 2
    assert again["checkpoint"].endswith("step_00000002")
    assert again["val_loss_1pass"] == first["val_loss_1pass"]  # same weights, same held-out batches
