"""Training runs for the experiments: ``fbt train`` in a subprocess (load what it saved with
:func:`fbt_megatron.checkpoint.model.load_checkpoint_model`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from data_pipeline.errors import UserError
from data_pipeline.output_dir import earlier_output
from fbt_megatron.errors import DIVERGED_EXIT
from fbt_megatron.files import TEMPORARY, write_text_atomic

ROOT = Path(__file__).resolve().parents[2]


# What a research run writes into its folder (fbt train's outputs, the command, the log, the read-outs, a
# killed atomic write's temporary file): a folder holding only these and its command.json is the run's own,
# replaced when the command changes.
RUN_ENTRIES = ("command.json", "train.log", "checkpoints", "metrics.jsonl", "summary.json", "tensorboard",
               "profile", "readouts.json", "run.lock", TEMPORARY)


class RunStopped(UserError):
    """``fbt train`` exited cleanly (status 0) short of its last step (preempted, ``train.stop_at_step``): the
    run is not finished, so its summary must not be read as a result; training it again with ``resume``
    continues from its checkpoint. (A stop on non-finite losses is :class:`RunDiverged`.)"""


class RunDiverged(UserError):
    """``fbt train`` stopped on non-finite losses (exit status 3, ``train.max_nonfinite_in_row``): the recipe
    diverged, a result to record, not a model to read out (its checkpoint holds the last finite weights)."""


def run_finished(summary: dict) -> bool:
    """Whether a run's summary says it trained to its last step (not preempted or stopped early) and did not
    diverge there."""
    return summary.get("step", -1) >= summary.get("total_steps", 0) > 0 and not divergence(summary)


def divergence(summary: dict) -> str | None:
    """The stop reason of a run that stopped on non-finite losses (a stop that is not a preemption; at any
    step, its last included); None otherwise."""
    return summary.get("stop_reason") if summary.get("stop_reason") and not summary.get("preempted") else None


def finished_run(run_dir: Path) -> dict | None:
    """:func:`run_summary` of the run in ``run_dir`` if it reached its last step; None if it has no summary or
    stopped early (training it again with ``resume`` continues from its checkpoint)."""
    run_dir = Path(run_dir)
    if not (run_dir / "summary.json").is_file():
        return None
    summary = run_summary(run_dir)
    return summary if run_finished(summary) else None


def diverged_run(run_dir: Path) -> str | None:
    """:func:`divergence` of the run in ``run_dir``; None if it has no summary."""
    path = Path(run_dir) / "summary.json"
    return divergence(json.loads(path.read_text())) if path.is_file() else None


def train_run(recipe: str, run_dir: Path, overrides: list[str], log_file: Path | None = None,
              resume: bool = False) -> dict:
    """``fbt train RECIPE run_dir=... OVERRIDES`` in a fresh process; returns :func:`run_summary` of the
    finished run, or raises :class:`RunStopped` if it stopped short of its last step (:class:`RunDiverged` on
    non-finite losses). From scratch, unless ``resume`` and ``run_dir`` holds a checkpoint of the same recipe
    and overrides: then the run continues from its latest checkpoint (a study interrupted mid-run loses no
    steps). A ``run_dir`` that this function did not start (no ``command.json``) and that is not empty is
    refused, nothing removed (:class:`data_pipeline.output_dir.OutputDirError`)."""
    run_dir = Path(run_dir)
    # the recipe as given (relative to ROOT, the subprocess's cwd): a run started from one checkout of the
    # repository resumes from another
    cmd = [sys.executable, "-m", "fbt_megatron.cli", "train", str(recipe), f"run_dir={run_dir}", *overrides]
    started = run_dir / "command.json"  # what the run was started with: resume only the same run
    same = started.exists() and json.loads(started.read_text()) == cmd[3:]
    resuming = resume and same and (run_dir / "checkpoints" / "latest").exists()
    if not resuming:
        # a folder this function started (command.json) is the run's own; anything else there is refused
        if earlier_output(run_dir, markers=(started.name,), patterns=RUN_ENTRIES, writer="a research run",
                          option="run folder"):
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(started, json.dumps(cmd[3:]))
    env = dict(os.environ, FBT_DEVICE=os.environ.get("FBT_DEVICE", "cpu"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with open(log_file or run_dir / "train.log", "a" if resuming else "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    # exit 3 records its stop; a run resumed at the last step it diverged on exits 0 and keeps that summary
    if rc in (0, DIVERGED_EXIT) and (reason := diverged_run(run_dir)):
        raise RunDiverged(f"the run in {run_dir} diverged ({reason}), so it is not used as a result; lower the "
                          "learning rate or raise train.max_nonfinite_in_row, and delete the folder to train it "
                          "afresh (resuming continues from its last finite checkpoint)")
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {rc}; see {log_file or run_dir / 'train.log'}")
    summary = run_summary(run_dir)
    if not run_finished(summary):
        raise RunStopped(f"the run in {run_dir} stopped at step {summary.get('step')} of "
                         f"{summary.get('total_steps')} ({summary.get('stop_reason') or 'no stop reason recorded'}), "
                         "so it is not used as a result; its checkpoint is kept, and the same command continues the "
                         "run from it (with --reuse where the tool has that option; not with sft_math's --force)")
    return summary


def run_summary(run_dir: Path) -> dict:
    """``run_dir/summary.json`` with ``val_history`` over the whole run, read from its metrics file: the
    summary's own covers only the last invocation, so a resumed run's curve would start at the resume."""
    from fbt_megatron.train.callbacks.metrics_file import read_val_history

    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    if (run_dir / "metrics.jsonl").is_file():
        summary["val_history"] = read_val_history(run_dir / "metrics.jsonl")
    return summary


def run_jobs(fn, args: list[tuple], jobs: int = 1) -> list:
    """``[fn(*a) for a in args]``, ``jobs`` at a time (training subprocesses; when several run at once each
    is given its share of the cores, ``FBT_CPU_THREADS``, unless that is set already, so that they do not
    each take them all). With several at once, a run that stops or diverges (:class:`RunStopped`,
    :class:`RunDiverged`) is printed to stderr when it does; the exception is raised once every run is done."""
    if jobs <= 1:
        return [fn(*a) for a in args]
    from concurrent.futures import ThreadPoolExecutor

    from fbt_megatron.runtime import CPU_THREADS_ENV, cpu_share

    def said_at_once(a):  # the pool raises only once every run is done: say a stop when it happens
        try:
            return fn(*a)
        except (RunStopped, RunDiverged) as e:
            print(e, file=sys.stderr, flush=True)
            raise

    mine = CPU_THREADS_ENV not in os.environ
    if mine:  # inherited by train_run's subprocesses while the pool runs
        os.environ[CPU_THREADS_ENV] = str(cpu_share(jobs))
    try:
        with ThreadPoolExecutor(jobs) as pool:
            return list(pool.map(said_at_once, args))
    finally:
        if mine:
            del os.environ[CPU_THREADS_ENV]
