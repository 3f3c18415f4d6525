"""On a real (local, one-node) SLURM: submit the tiny recipe through `fbt slurm submit`, preempt it with
USR1 (what `--signal=B:USR1@N` sends), let it requeue itself and finish; its losses and sample stream
equal an uninterrupted run's. A job cancelled in the middle of a save leaves `latest` loadable.

Layouts: 2 processes as TP=2 (DP=1) and as DP=2 (ZeRO-1).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.distributed import run_distributed
from tests.support.training import effective_stream, load_latest_weights, read_metrics

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[2]
# The tiny recipe, shortened: synthetic data (the embedded mix takes minutes to build), 8 steps with
# feedback from step 3, checkpoints only when preempted and at the end, no validation.
TINY_SHORT = ["data.source=synthetic", "train.steps=8", "schedule.feedback_start_step=3",
              "checkpoint.every=1000", "eval.at_end=false", "logging.tensorboard=false", "logging.log_every=1"]


TP2 = "parallel.tensor=2"  # 2 processes as TP=2, DP=1
DP2 = "parallel.tensor=1"  # 2 processes as DP=2 (ZeRO-1)


def _submit(run_dir: Path, *extra: str, layout: str = TP2, env=None) -> tuple[str, Path]:
    cmd = [sys.executable, "-m", "fbt_megatron.cli", "slurm", "submit", "recipes/tiny.yaml", "--gpus-per-node", "2",
           "--cpu", "--time", "00:30:00", "--signal-seconds", "60", *TINY_SHORT, layout, *extra, f"run_dir={run_dir}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    job = re.search(r"job (\d+)", r.stdout).group(1)
    return job, next((run_dir / "slurm").glob("*.sbatch"))


def _job(job: str) -> dict:
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def _wait(cond, timeout: float, what: str, log: Path | None = None, running: str | None = None):
    """Poll ``cond`` until it holds; fail after ``timeout`` s, or as soon as job ``running`` has ended without it
    (the job's log tail in the message)."""
    deadline, ended = time.time() + timeout, False
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        ended = running is not None and _finished(running)
        if ended and not cond():
            break
        time.sleep(0.5)
    tail = log.read_text()[-3000:] if log and log.exists() else ""
    why = f"job {running} ended first" if ended else f"timed out after {timeout}s"
    raise AssertionError(f"{why}, waiting for {what}\n{tail}")


def _finished(job: str) -> bool:
    return _job(job).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


@pytest.mark.parametrize("layout", [TP2, DP2], ids=["tp2", "dp2"])
def test_submit_preempt_requeue_resumes_exactly(slurm_cluster, tmp_path, layout):
    ref_job, _ = _submit(tmp_path / "straight", layout=layout)
    job, script = _submit(tmp_path / "preempted", layout=layout)
    text = script.read_text()
    assert "#SBATCH --signal=B:USR1@60" in text and "--rdzv-backend=c10d" in text and "--requeue" in text
    log = tmp_path / "preempted" / "slurm" / "logs" / f"tiny-{job}.out"

    # USR1 to the batch shell (exactly what --signal=B:USR1@N delivers) once step 3 has run
    # the waits add up to less than pytest's 900 s, so a slow run fails here with the job's log, not a stack dump
    _wait(lambda: any(r["step"] >= 3 for r in read_metrics(tmp_path / "preempted")), 300, "step 3", log, running=job)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
    _wait(lambda: _finished(ref_job) and _finished(job) and _job(job).get("Restarts") == "1", 540,
          "the requeued job to finish", log)  # generous: about 90 s on two idle cores
    assert _job(job)["JobState"] == "COMPLETED", log.read_text()[-3000:]
    assert _job(ref_job)["JobState"] == "COMPLETED"

    rows, ref = read_metrics(tmp_path / "preempted"), read_metrics(tmp_path / "straight")
    first = [r for r in rows if r.get("slurm_restart", "0") == "0"]
    second = [r for r in rows if r.get("slurm_restart") == "1"]
    stop = first[-1]["step"]
    assert 3 <= stop < 8 and second, rows
    assert f"checkpoint saved: {tmp_path / 'preempted' / 'checkpoints' / f'step_{stop:08d}'}" in log.read_text()
    # no lost or repeated samples: the requeued job starts right after the preemption step
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["data_checksum"] for r in rows] == [r["data_checksum"] for r in ref]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(rows, ref)) < 1e-6
    assert "[fbt] requeueing job" in log.read_text()

    status = subprocess.run([sys.executable, "-m", "fbt_megatron.cli", "slurm", "status", str(tmp_path / "preempted")],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert f"job {job} tiny: COMPLETED" in status.stdout and "step 8/8" in status.stdout, status.stdout
    assert "latest checkpoint: step_00000008" in status.stdout


def test_cancel_mid_save_keeps_latest_loadable(slurm_cluster, tmp_path):
    import os

    env = dict(os.environ, FBT_TEST_SLOW_SAVE_STEP="4")
    job, _ = _submit(tmp_path, "--train-module", "tests.support.slow_save", "checkpoint.every=2", env=env)
    log = tmp_path / "slurm" / "logs" / f"tiny-{job}.out"
    _wait(lambda: (tmp_path / "checkpoints" / "saving_4").exists(), 600, "the save of step 4", log, running=job)  # with the next wait, < 900 s
    assert (tmp_path / "checkpoints" / "step_00000004.tmp" / "weights").is_dir()  # halfway through it
    subprocess.run(["scancel", job], check=True)  # SIGTERM, then SIGKILL after KillWait
    _wait(lambda: _finished(job), 120, "the cancelled job to end", log)
    assert _job(job)["JobState"] == "CANCELLED"

    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    from fbt_megatron.recipe import load_recipe

    recipe = load_recipe(ROOT / "recipes" / "tiny.yaml", [*TINY_SHORT, DP2])  # loads into another layout
    from fbt_megatron.runtime import ParallelLayout

    got = run_distributed(load_latest_weights, 1, str(tmp_path), recipe.model_dump(mode="json"),
                          layout=ParallelLayout())[0]
    assert got["latest"] == "step_00000002" and got["step"] == 2
    assert got["params_changed"] == got["params"]  # every tensor came from the checkpoint
