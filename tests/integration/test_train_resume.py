"""Resume equivalence: a straight run equals an interrupted + resumed run (same layout)."""

import json

import pytest

from tests.support.distributed import run_distributed
from tests.support.training import losses, tiny_recipe, train_fn

SECTIONS = dict(train={"steps": 10}, schedule={"feedback_start_step": 4, "mix": [0.2, 0.5, 0.3], "seed": 3},
                checkpoint={"every": 1000, "at_end": True})


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = run_distributed(train_fn, 1, tiny_recipe(tmp_path_factory.mktemp("straight"), **SECTIONS))[0]
    assert [h[1] for h in out["history"]][:4] == [1, 1, 1, 1]
    assert max(h[1] for h in out["history"][5:]) > 1  # feedback steps after the resume point
    return out


def _interrupted(run_dir, first_world, first_parallel, second_world, second_parallel):
    first = tiny_recipe(run_dir, **SECTIONS)
    first["parallel"].update(first_parallel)
    first["train"]["stop_at_step"] = 5
    a = run_distributed(train_fn, first_world, first)[0]
    assert a["step"] == 5 and a["checkpoint"]
    second = tiny_recipe(run_dir, **SECTIONS)
    second["parallel"].update(second_parallel)
    b = run_distributed(train_fn, second_world, second)[0]
    assert b["history"][0][0] == 5 and b["step"] == 10
    return a, b


def test_resume_equals_straight_run(straight, tmp_path):
    a, b = _interrupted(tmp_path, 1, {}, 1, {})
    got, ref = losses(a) + losses(b), losses(straight)
    assert max(abs(x - y) for x, y in zip(got, ref)) < 1e-6, (got, ref)
    assert [h[1] for h in a["history"] + b["history"]] == [h[1] for h in straight["history"]]
    saved = tmp_path / "checkpoints" / "step_00000005" / "state.json"  # the interrupted run's checkpoint (kept: keep_last=2)
    assert saved.is_file(), sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    state = json.loads(saved.read_text())
    assert state["pass_schedule"]["position"] == 5
    assert state["data_cursor"]["consumed_sequences"] == 5 * 8


# Resumes under other layouts (DP, TP, ZeRO in both directions): tests/integration/test_checkpoint_layouts.py.
