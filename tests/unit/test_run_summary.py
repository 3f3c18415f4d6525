"""A run's ``summary.json`` describes its latest state: research tools read a run as finished only if its
summary is at its last step, so a summary lost or left older by a kill is written again on relaunch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("left_behind", [None, {"step": 1, "total_steps": 2}, {"step": 2, "total_steps": 5}, []],
                         ids=["missing", "older", "of_other_steps", "not_a_summary"])
def test_a_run_killed_between_its_last_save_and_its_summary_gets_one_when_launched_again(tmp_path, single_process,
                                                                                       left_behind):
    """Launched again, a run whose checkpoint is at its last step but whose summary is missing or older
    (killed in between) writes the summary of that step; a current summary is kept as it is."""
    from fbt_megatron.recipe import load_recipe
    from fbt_megatron.train.run import train

    recipe = load_recipe(ROOT / "recipes" / "tiny.yaml", [
        "data.source=synthetic", "train.steps=2", "checkpoint.every=1000", "eval.at_end=false",
        "logging.tensorboard=false", f"run_dir={tmp_path / 'run'}"])
    train(recipe)
    summary = tmp_path / "run" / "summary.json"
    current = json.loads(summary.read_text())
    assert current["step"] == current["total_steps"] == 2
    summary.write_text(json.dumps({**current, "kept": True}))
    train(recipe)  # nothing to train: a current summary stays
    assert json.loads(summary.read_text()).get("kept")
    if left_behind is None:
        summary.unlink()
    else:
        summary.write_text(json.dumps(left_behind))
    train(recipe)
    again = json.loads(summary.read_text())
    assert again["step"] == again["total_steps"] == 2 and "kept" not in again
