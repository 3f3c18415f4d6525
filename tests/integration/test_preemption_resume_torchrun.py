"""Preemption outside SLURM (issue 24), so the claim is covered wherever the suite runs: a torchrun
training run (2 gloo workers, DP=2, ZeRO-1) gets SIGTERM on torchrun itself (what `docker stop`, a
Kubernetes eviction or a plain `kill` sends). torchrun passes it to its workers; the `Preemption`
callback finishes the step in flight, every rank stops after the same step, a checkpoint is saved and the
workers exit 0 within torchrun's grace period (`--shutdown-timeout`, 30 s by default, 120 s here for a
loaded machine; SIGKILL after it). A relaunch on the same run directory resumes from
`latest` and finishes. The resumed trajectory equals an uninterrupted run's **bitwise**: every step's
loss and data checksum (from `metrics.jsonl`, a step trained by both launches counted once: none is)
and the final fp32 parameters. The relaunch and the uninterrupted run go through
`run_distributed` (the same `train()` as `fbt train`, 2 gloo processes, 1 thread each, as under
torchrun) so that their final parameters can be read.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from fbt_megatron.runtime import _free_port
from tests.support.distributed import child_pids, run_distributed
from tests.support.training import read_metrics, tiny_recipe, train_fn

ROOT = Path(__file__).resolve().parents[2]
STEPS = 50  # ~0.04 s a step here: a window of seconds for the signal to land before the end
# dropout on: the trajectory then depends on the RNG state the checkpoint restores
SECTIONS = dict(model={"hidden_dropout": 0.1, "attention_dropout": 0.1}, train={"steps": STEPS}, parallel={"tensor": 1, "zero_stage": 1},
                checkpoint={"every": 1000, "at_end": True, "keep_last": 2}, eval={"every": 1000, "at_end": False},
                schedule={"feedback_start_step": 2, "mix": [0.2, 0.5, 0.3], "seed": 3})


@pytest.mark.timeout(900)
def test_sigterm_to_torchrun_then_relaunch_equals_an_uninterrupted_run(tmp_path):
    straight = run_distributed(train_fn, 2, tiny_recipe(tmp_path / "straight", **SECTIONS), None, None, None,
                               "final_params")[0]
    straight_rows = read_metrics(tmp_path / "straight")
    assert [r["step"] for r in straight_rows] == list(range(1, STEPS + 1))

    run_dir = tmp_path / "run"
    recipe = tiny_recipe(run_dir, **SECTIONS)
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe))
    log = tmp_path / "torchrun.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=0",
           "--shutdown-timeout=120", "--monitor-interval=0.5", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
           "-m", "fbt_megatron.cli", "train", str(recipe_file)]
    env = dict(os.environ, FBT_DEVICE="cpu", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    workers = []
    try:
        deadline = time.time() + 400
        while not any(r["step"] >= 3 for r in read_metrics(run_dir)):
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-4000:]
            time.sleep(0.1)
        workers = child_pids(proc.pid)
        assert len(workers) == 2, workers
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = log.read_text()
    first = read_metrics(run_dir)
    stopped_at = first[-1]["step"]
    assert 3 <= stopped_at < STEPS, text[-4000:]
    assert "preempted: SIGTERM received" in text and "closing signal SIGKILL" not in text, text[-4000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{stopped_at:08d}"  # saved at the stop

    resumed = run_distributed(train_fn, 2, recipe, None, None, None, "final_params")[0]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "a step was skipped or trained twice"
    assert resumed["history"][0][0] == stopped_at  # the relaunch started at the step after the checkpoint
    for got, want in zip(rows, straight_rows):
        assert (got["step"], got["data_checksum"], got["passes"]) == (want["step"], want["data_checksum"],
                                                                      want["passes"])
        assert got["loss"] == want["loss"], (got["step"], got["loss"], want["loss"])  # bitwise
        assert got.get("train/grad_norm") == want.get("train/grad_norm"), got["step"]
    got_p, want_p = resumed["probe"], straight["probe"]
    assert got_p.keys() == want_p.keys() and got_p
    for name in want_p:
        assert torch.equal(got_p[name], want_p[name]), name
    print(f"preempted after step {stopped_at}; the resumed run equals the uninterrupted one bitwise "
          f"({len(rows)} losses, {len(want_p)} parameter tensors)")
