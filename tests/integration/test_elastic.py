"""Elastic restart: torchrun --nnodes MIN:MAX --max-restarts N with 2 local workers; one worker is
SIGKILLed mid-run, the group restarts, resumes from `latest` and the sample stream has no gap or
repeat; a later launch with 1 worker continues the same stream. Compared with a straight 1-process run
(data checksums equal, losses within float noise of another layout).

Two 2-worker layouts: TP=2 (DP=1) and DP=2 (ZeRO-1); the 1-worker relaunch is TP=1, DP=1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fbt_megatron.runtime import _free_port
from tests.support.distributed import child_pids, run_distributed
from tests.support.training import effective_stream, read_metrics, tiny_recipe, train_fn

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = dict(train={"steps": 10, "stop_at_step": 7}, checkpoint={"every": 2, "at_end": True, "keep_last": 2},
                schedule={"feedback_start_step": 3, "mix": [0.2, 0.5, 0.3], "seed": 3})


def _torchrun(recipe_file: Path, nproc: int, overrides: list[str], log: Path, hold_after_save: int | None = None
              ) -> subprocess.Popen:
    """``hold_after_save``: the first attempt holds after that step's checkpoint (testing/slow_save.py)."""
    module = "fbt_megatron.cli" if hold_after_save is None else "tests.support.slow_save"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", f"--nproc-per-node={nproc}",
           "--max-restarts=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
           "--rdzv-conf=last_call_timeout=1", "-m", module, "train", str(recipe_file), *overrides]
    env = dict(os.environ, FBT_DEVICE="cpu", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               FBT_TEST_HOLD_AFTER_SAVE_STEP=str(-1 if hold_after_save is None else hold_after_save))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun's workers (their own process groups) and then torchrun: only what we started."""
    for pid in child_pids(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()
    proc.wait()


def _finish(proc: subprocess.Popen, log: Path, timeout: float = 1200) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        rc = "timeout"
    assert rc == 0, f"torchrun exited {rc}:\n{log.read_text()[-4000:]}"


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = run_distributed(train_fn, 1, tiny_recipe(tmp_path_factory.mktemp("straight"),
                                                   **dict(SECTIONS, train={"steps": 10})))[0]
    return {h[0] + 1: (h[4], h[2]) for h in out["history"]}  # step (1-based, as in metrics.jsonl) -> stream


@pytest.mark.parametrize("parallel", [
    {"tensor": 2, "zero_stage": 1},
    {"tensor": 1, "zero_stage": 1},
], ids=["tp2", "dp2"])
def test_worker_killed_group_restarts_then_one_worker_continues(straight, tmp_path, parallel):
    recipe = tiny_recipe(tmp_path / "run", **SECTIONS)
    recipe["parallel"].update(parallel)
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe))
    log = tmp_path / "torchrun.log"
    run_dir = tmp_path / "run"

    proc = _torchrun(recipe_file, 2, [], log, hold_after_save=4)
    try:
        deadline = time.time() + 900
        while not (run_dir / "checkpoints" / "held_4").exists():  # past the step-2 and step-4 checkpoints
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        workers = child_pids(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        _finish(proc, log)
    finally:
        if proc.poll() is None:
            _kill_tree(proc)

    rows = read_metrics(run_dir)
    restarted = [r for r in rows if r.get("elastic_restart", "0") != "0"]
    assert restarted, f"no restart happened:\n{log.read_text()[-4000:]}"
    resumed_at = restarted[0]["step"] - 1
    assert resumed_at % 2 == 0 and (run_dir / "checkpoints").is_dir()  # a checkpoint step: from latest
    killed_at = max(r["step"] for r in rows if r.get("elastic_restart", "0") == "0")
    assert resumed_at <= killed_at < resumed_at + 3  # nothing before the checkpoint is trained twice
    assert killed_at == resumed_at == 4  # held after the step-4 checkpoint: killed there, resumed from it
    assert rows[-1]["step"] == 7 and rows[-1]["world_size"] == 2

    # a relaunch with one worker continues the same stream (TP=1 now)
    log1 = tmp_path / "torchrun1.log"
    _finish(_torchrun(recipe_file, 1, ["parallel.tensor=1", "train.stop_at_step=10"], log1), log1)
    rows = read_metrics(run_dir)
    assert rows[-1]["world_size"] == 1 and [r["step"] for r in rows if r["world_size"] == 1] == [8, 9, 10]

    got = effective_stream(rows)
    assert sorted(got) == list(range(1, 11))  # no gap
    for step, (checksum, loss) in got.items():
        assert checksum == straight[step][0], f"step {step}: other samples than the straight run"
        assert abs(loss - straight[step][1]) < 1e-5, (step, loss, straight[step][1])
    # a step trained twice (after the kill, before the restart) saw the same samples both times
    for r in rows:
        assert r["data_checksum"] == got[r["step"]][0]
