"""CPU threads: ``fbt train`` takes ``FBT_CPU_THREADS`` when set (jobs sharing the cores), else the cores
shared among the node's ranks; the study's parallel jobs each get their share."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fbt_megatron.runtime import CPU_THREADS_ENV, cpu_share, cpu_threads

ROOT = Path(__file__).resolve().parents[2]


def test_thread_count_rule():
    assert cpu_threads(1, {CPU_THREADS_ENV: "3"}, cpu_count=16) == 3
    assert cpu_threads(4, {CPU_THREADS_ENV: " 1 "}, cpu_count=16) == 1
    assert cpu_threads(1, {}, cpu_count=16) == 16
    assert cpu_threads(4, {}, cpu_count=16) == 4
    assert cpu_threads(4, {}, cpu_count=2) == 1  # never zero
    # torchrun sets OMP_NUM_THREADS=1 where it is unset: a 16-core node's 2 ranks still get 8 each
    assert cpu_threads(2, {"OMP_NUM_THREADS": "1"}, cpu_count=16) == 8
    for unusable in ("", "0", "two", "-1", "²"):  # not a positive count: the even share
        assert cpu_threads(2, {CPU_THREADS_ENV: unusable}, cpu_count=16) == 8
    assert [cpu_share(n, cpu_count=8) for n in (1, 2, 3, 8, 9)] == [8, 4, 2, 1, 1]


def test_parallel_jobs_get_their_share_while_they_run(monkeypatch):
    from fbt_megatron.research.runs import run_jobs

    monkeypatch.delenv(CPU_THREADS_ENV, raising=False)
    seen = run_jobs(lambda i: os.environ.get(CPU_THREADS_ENV), [(i,) for i in range(3)], jobs=2)
    assert seen == [str(cpu_share(2))] * 3 and CPU_THREADS_ENV not in os.environ  # restored afterwards
    assert run_jobs(lambda i: os.environ.get(CPU_THREADS_ENV), [(0,)], jobs=1) == [None]
    monkeypatch.setenv(CPU_THREADS_ENV, "5")  # the user's count is kept
    assert run_jobs(lambda i: os.environ.get(CPU_THREADS_ENV), [(0,), (1,)], jobs=2) == ["5", "5"]
    assert os.environ[CPU_THREADS_ENV] == "5"


@pytest.mark.slow  # one short training in a subprocess
def test_train_takes_the_thread_count_it_is_given(tmp_path):
    """One process on a machine of several cores, ``FBT_CPU_THREADS=1``: the run's header says one thread
    (all the cores otherwise)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: one thread is also the default")
    cmd = [sys.executable, "-m", "fbt_megatron.cli", "train", "recipes/tiny.yaml", f"run_dir={tmp_path / 'run'}",
           "train.steps=1", "eval.at_end=false", "data.valid_sequences=8", "logging.tensorboard=false"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), FBT_DEVICE="cpu", **{CPU_THREADS_ENV: "1"})
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert ", CPU threads 1" in proc.stderr, proc.stderr[-2000:]


def test_the_share_counts_the_cores_this_process_may_use():
    """A process bound to one core (a SLURM task, taskset) shares that core, not the machine's."""
    if not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2:
        pytest.skip("needs CPU affinity and two cores")
    code = ("import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
            "from fbt_megatron.runtime import cpu_share; print(cpu_share(1))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "1", out.stderr[-2000:]
