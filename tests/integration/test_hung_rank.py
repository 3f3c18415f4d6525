"""A rank that stops responding does not hang the job (issue 21): with `train.collective_timeout_s` the
other rank's next collective fails within that time (gloo), its worker exits with an error, torchrun
stops the group (SIGKILL for the stopped process after its fixed 30 s grace period) and, with a restart
left, starts the group again; the new group resumes from `checkpoints/latest` and
finishes the run.

--max-restarts=3, not 1: on a heavily loaded machine a start-up skew between the two workers above the
short timeout fails a group's gloo connect too, which costs a restart; the test then follows the last
restart's rows. Its deadlines are generous for the same reason (about 90 s on 2 cores under light load,
several minutes under heavy load).

The hung rank is simulated with SIGSTOP on one of 2 torchrun workers (DP=2, ZeRO-1, gloo) after step 3.
Without the timeout plumbing (the default 10 minutes) the test fails at its own deadline, not by hanging.
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
from tests.support.distributed import child_pids
from tests.support.training import read_metrics, tiny_recipe

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 20  # also bounds the start-up skew between the ranks (gloo connects within it): not too short
SLACK_S = 30  # a loaded 2-core machine
STEPS = 8


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.timeout(900)
def test_stopped_rank_fails_the_group_within_the_timeout_and_torchrun_restarts_from_latest(tmp_path):
    run_dir = tmp_path / "run"
    recipe = tiny_recipe(run_dir, train={"steps": STEPS, "collective_timeout_s": TIMEOUT_S},
                         parallel={"tensor": 1, "zero_stage": 1},
                         checkpoint={"every": 2, "at_end": True, "keep_last": 2}, eval={"every": 1000, "at_end": False})
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe))
    log = tmp_path / "torchrun.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=3",
           "--monitor-interval=0.5", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
           "-m", "fbt_megatron.cli", "train", str(recipe_file)]
    env = dict(os.environ, FBT_DEVICE="cpu", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    workers, stopped, t0 = [], None, time.time()
    try:
        while not any(r["step"] >= 3 for r in read_metrics(run_dir)):
            assert proc.poll() is None and time.time() - t0 < 400, log.read_text()[-4000:]
            time.sleep(0.2)
        workers = child_pids(proc.pid)
        assert len(workers) == 2, workers
        stopped = workers[1]
        os.kill(stopped, signal.SIGSTOP)
        restart_at_stop = int(read_metrics(run_dir)[-1].get("elastic_restart", "0"))  # the start stopped
        timeouts_before = log.read_text().count("Timed out waiting")
        t_stop = time.time()
        latest_at_stop = (run_dir / "checkpoints" / "latest").read_text().strip()
        # the other rank's collective fails within the timeout (+ slack), not after the default 10 minutes
        while log.read_text().count("Timed out waiting") == timeouts_before:
            assert time.time() - t_stop < TIMEOUT_S + SLACK_S, \
                f"no collective timeout {time.time() - t_stop:.0f}s after SIGSTOP:\n{log.read_text()[-4000:]}"
            time.sleep(0.5)
        failed_after = time.time() - t_stop
        rows_before_restart = read_metrics(run_dir)  # the stopped start can write no more; the restart not yet
        # torchrun kills the stopped worker (30 s grace), restarts the group, which finishes the run
        rc = proc.wait(timeout=30 + 400)
        ended_after = time.time() - t_stop
    finally:
        if proc.poll() is None:
            for pid in child_pids(proc.pid):
                _kill(pid)
            proc.kill()
            proc.wait()
        for pid in workers:  # only the workers this test saw started
            _kill(pid)
    text = log.read_text()
    assert rc == 0, f"torchrun exited {rc}:\n{text[-4000:]}"
    assert "Timed out waiting" in text and failed_after < TIMEOUT_S + SLACK_S

    rows = read_metrics(run_dir)
    # the first start's rows as they were before the restart: a resume drops the rows of the steps it trains
    # again from metrics.jsonl (one row a step), so they are read here, not from the file at the end
    first = [r for r in rows_before_restart if int(r.get("elastic_restart", "0")) == restart_at_stop]
    last = max(int(r.get("elastic_restart", "0")) for r in rows)
    restarted = [r for r in rows if int(r.get("elastic_restart", "0")) == last]
    assert last > restart_at_stop, f"no restart happened:\n{text[-4000:]}"
    # the restarted group resumed from `latest` (a checkpoint step: the one named when the rank stopped, or
    # the next if its save was being published at that moment) and finished the run
    resumed_at, trained = restarted[0]["step"] - 1, max(r["step"] for r in first)
    assert resumed_at % 2 == 0 and int(latest_at_stop.split("_")[1]) <= resumed_at <= trained, \
        (latest_at_stop, resumed_at, trained)
    assert [r["step"] for r in restarted] == list(range(restarted[0]["step"], STEPS + 1))
    assert trained >= 3
    # a step trained twice saw the same samples both times
    again = {r["step"]: r["data_checksum"] for r in restarted}
    for r in first:
        if r["step"] in again:
            assert r["data_checksum"] == again[r["step"]], r["step"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:08d}"
    print(f"collective failed {failed_after:.1f}s after SIGSTOP (timeout {TIMEOUT_S}s); resumed at step "
          f"{restarted[0]['step']}; torchrun done {ended_after:.1f}s after SIGSTOP, {time.time() - t0:.0f}s in all")
