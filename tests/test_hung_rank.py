"""A rank that stops responding does not hang the job: with `train.collective_timeout_s` the other rank's
next collective fails within that time (gloo), its worker exits with an error, and torchrun stops the
group (SIGKILL for the stopped process after its 30 s grace period) and ends, as it does for any
worker failure: with restarts left it starts the group again from `latest`, which
tests/test_elastic.py shows for a killed worker. Here --max-restarts=0 keeps the test short and
independent of the restart (on this loaded 2-core machine a restart after the hang sometimes waited
minutes in torchrun's rendezvous).

The hung rank is simulated with SIGSTOP on one torchrun worker after step 3 (2 workers, DP=2)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from fbt_megatron.runtime import _free_port
from fbt_megatron.train.testing import read_metrics, tiny_recipe

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60  # also bounds the start-up skew between the ranks (gloo connects within it): not too short


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return sorted(out)


def test_stopped_rank_fails_the_group_within_the_timeout_and_torchrun_restarts(tmp_path):
    run_dir = tmp_path / "run"
    recipe = tiny_recipe(run_dir, train={"steps": 5, "collective_timeout_s": TIMEOUT_S},
                         parallel={"tensor": 1, "zero_stage": 1},
                         checkpoint={"every": 2, "at_end": True}, eval={"every": 1000, "at_end": False})
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe))
    log = tmp_path / "torchrun.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=0",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "-m", "fbt_megatron.cli", "train",
           str(recipe_file)]
    env = dict(os.environ, FBT_DEVICE="cpu", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    stopped = None
    try:
        deadline = time.time() + 600
        while not any(r["step"] >= 3 for r in read_metrics(run_dir)):
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        stopped = workers[1]
        os.kill(stopped, signal.SIGSTOP)
        t_stop = time.time()
        # the other rank's collective fails within the timeout (+ slack for a loaded machine)
        while "Timed out" not in log.read_text() and "timed out" not in log.read_text().lower():
            assert time.time() - t_stop < TIMEOUT_S + 60, log.read_text()[-4000:]
            time.sleep(0.5)
        failed_after = time.time() - t_stop
        rc = proc.wait(timeout=300)  # the stopped worker is killed after torchrun's grace period
        ended_after = time.time() - t_stop
    finally:
        if proc.poll() is None:
            for pid in _children(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait()
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = log.read_text()
    assert rc != 0 and failed_after < TIMEOUT_S + 60, text[-4000:]
    assert "Timed out waiting" in text and ended_after < TIMEOUT_S + 60 + 30 + 60, (ended_after, text[-4000:])
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"  # what a restart resumes
    print(f"collective failed {failed_after:.1f}s after SIGSTOP (timeout {TIMEOUT_S}s); torchrun ended after "
          f"{ended_after:.1f}s")
