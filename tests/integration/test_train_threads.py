"""A CPU run takes the thread count the user asked for: ``OMP_NUM_THREADS`` when set (the feedback study
runs two trainings at once with one thread each), else the cores shared among the node's ranks."""

import os
import subprocess
import sys
from pathlib import Path

from fbt_megatron.runtime import cpu_threads

ROOT = Path(__file__).resolve().parents[2]


def test_thread_count_rule():
    assert cpu_threads(1, {"OMP_NUM_THREADS": "3"}, cpu_count=16) == 3
    assert cpu_threads(4, {"OMP_NUM_THREADS": " 1 "}, cpu_count=16) == 1
    assert cpu_threads(1, {}, cpu_count=16) == 16
    assert cpu_threads(4, {}, cpu_count=16) == 4
    assert cpu_threads(4, {}, cpu_count=2) == 1  # never zero
    for unusable in ("", "0", "two", "-1"):  # not a positive count: the even share
        assert cpu_threads(2, {"OMP_NUM_THREADS": unusable}, cpu_count=16) == 8


def test_train_honours_omp_num_threads(tmp_path):
    """One process on a machine of several cores, ``OMP_NUM_THREADS=1``: the run's header says one thread
    (before, the CLI set the thread count to all the cores whatever the environment said)."""
    assert (os.cpu_count() or 1) > 1, "the check needs a machine of two cores or more"
    cmd = [sys.executable, "-m", "fbt_megatron.cli", "train", "recipes/tiny.yaml", f"run_dir={tmp_path / 'run'}",
           "train.steps=1", "eval.at_end=false", "data.valid_sequences=8", "logging.tensorboard=false"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), FBT_DEVICE="cpu", OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None), env.pop("LOCAL_WORLD_SIZE", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert ", CPU threads 1" in proc.stderr, proc.stderr[-2000:]
