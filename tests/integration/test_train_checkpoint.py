"""Checkpoints: atomic publication, a save killed halfway, keep-last-N, non-finite losses, no pickle."""

import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fbt_megatron.checkpoint.safe_load import SafePickleModule as _SafePickleModule
from tests.support.distributed import run_distributed
from tests.support.training import tiny_recipe, train_fn

ROOT = Path(__file__).resolve().parents[2]


def _killed_run(recipe: dict, tmp_path: Path, fault: str) -> tuple[int, str]:
    """`fbt train` whose checkpoint save is killed at ``fault`` (``<point>@<step>``, through the save's
    fault hook: tests.support.training's runner), in its own session; a process killed mid-save can
    leave helper processes (megatron's writer queue manager) behind, so the whole session is killed."""
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), FBT_DEVICE="cpu")
    log = tmp_path / "train.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tests.support.training", str(path), fault], cwd=ROOT,
                                env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=300)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return rc, log.read_text()


def test_save_killed_halfway_keeps_previous_checkpoint(tmp_path):
    recipe = tiny_recipe(tmp_path / "run", train={"steps": 4}, checkpoint={"every": 2, "at_end": True})
    # The process dies after the weights of the step-4 save are written, before publication.
    rc, log = _killed_run(recipe, tmp_path, "after_weights@4")
    assert rc == 17, log[-3000:]
    ckpts = tmp_path / "run" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000002"
    assert (ckpts / "step_00000004.tmp").is_dir() and not (ckpts / "step_00000004").exists()
    # The previous checkpoint loads and the run finishes from it; the stale .tmp is cleaned up.
    out = run_distributed(train_fn, 1, recipe)[0]
    assert out["history"][0][0] == 2 and out["step"] == 4
    assert (ckpts / "latest").read_text().strip() == "step_00000004"
    assert not (ckpts / "step_00000004.tmp").exists()


def test_killed_before_latest_update_and_keep_last(tmp_path):
    recipe = tiny_recipe(tmp_path / "run", train={"steps": 6}, checkpoint={"every": 2, "keep_last": 2})
    rc, log = _killed_run(recipe, tmp_path, "before_latest@6")
    assert rc == 17, log[-3000:]
    ckpts = tmp_path / "run" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000004"
    out = run_distributed(train_fn, 1, recipe)[0]
    assert out["history"][0][0] == 4 and out["step"] == 6
    published = sorted(p.name for p in ckpts.glob("step_*"))
    assert published == ["step_00000004", "step_00000006"]  # keep_last=2
    state = json.loads((ckpts / "step_00000006" / "state.json").read_text())
    assert state["train_state"]["step"] == 6 and state["data_cursor"]["consumed_sequences"] == 6 * 8
    assert state["pass_schedule"]["position"] == 6


def test_nonfinite_steps_are_skipped_and_counted(tmp_path):
    """A NaN loss at step 2 (DP=1, ZeRO-0): the step is flagged and counted, the weights, both moments and
    Adam's step count after it are those after step 1, and the next step is applied and finite. The steps
    before the fault are the clean run's. (Other faults and ZeRO stages: test_train_nonfinite.py.)"""
    import torch

    clean = run_distributed(train_fn, 1, tiny_recipe(tmp_path / "clean", train={"steps": 3}))[0]
    out = run_distributed(train_fn, 1, tiny_recipe(tmp_path / "nan", train={"steps": 5}), [2], None, None,
                          "step_states")[0]
    assert out["skipped_steps"] == 1 and out["stop_reason"] is None and out["step"] == 5
    hist, states = out["history"], out["probe"]
    assert [h[3] for h in hist] == [False, False, True, False, False] and hist[2][2] != hist[2][2]  # NaN
    assert [h[2] for h in hist[:2]] == [h[2] for h in clean["history"][:2]]
    assert states[2]["adam_step"] == states[1]["adam_step"] == 2 and states[3]["adam_step"] == 3
    for key in ("params", "exp_avg", "exp_avg_sq"):
        for name, value in states[1][key].items():
            assert torch.equal(states[2][key][name], value), f"the skipped step changed {key} of {name}"
    assert all(h[2] == h[2] for h in hist[3:])  # finite (not NaN)
    assert not torch.equal(states[3]["params"]["feedback.value.weight"], states[2]["params"]["feedback.value.weight"])


def test_too_many_nonfinite_in_a_row_stops_with_loadable_checkpoint(tmp_path):
    recipe = tiny_recipe(tmp_path / "run", train={"steps": 8, "max_nonfinite_in_row": 3})
    out = run_distributed(train_fn, 2, recipe, [2, 3, 4])  # DP=2: every rank agrees to skip
    s = out[0]
    assert s["stop_reason"] and "3 non-finite losses in a row" in s["stop_reason"]
    assert s["step"] == 5 and s["skipped_steps"] == 3
    ckpts = tmp_path / "run" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000005"
    resumed = run_distributed(train_fn, 1, recipe)[0]  # loads (at DP=1) and finishes
    assert resumed["history"][0][0] == 5 and resumed["step"] == 8 and resumed["stop_reason"] is None
    assert resumed["skipped_steps"] == 3  # the count is part of the checkpointed state


def test_checkpoint_metadata_loader_refuses_code():
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with pytest.raises(pickle.UnpicklingError):
        _SafePickleModule.loads(pickle.dumps(Evil()))
    from torch.distributed.checkpoint.metadata import Metadata

    assert isinstance(_SafePickleModule.loads(pickle.dumps(Metadata(state_dict_metadata={}))), Metadata)


def test_async_save_publishes_and_resumes(tmp_path):
    recipe = tiny_recipe(tmp_path / "run", train={"steps": 4},
                         checkpoint={"every": 2, "at_end": True, "async_save": True})
    run_distributed(train_fn, 2, recipe)
    ckpts = tmp_path / "run" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000004"
    assert not list(ckpts.glob("*.tmp"))
    recipe["train"]["steps"] = 6
    out = run_distributed(train_fn, 1, recipe)[0]
    assert out["history"][0][0] == 4 and out["step"] == 6
