"""Build a cached directory (a venv) once, for the test-support modules that cache venvs (vllm_env, corner_env,
transformers_envs, gpu_image_env): ``build_once(venv, build)`` returns ``venv`` when it is ready, else builds it.

Builders of the same ``venv`` take turns on ``<venv.name>.lock`` beside it (``fcntl.flock``; the wait bounded by
``wait_s`` when given: ``TimeoutError`` naming the lock file as its ``filename``), and the one holding the lock
checks again whether the one before built it. A build runs in ``<venv.name>.building-PID`` and is renamed into
place only after ``build`` returned (its return value becomes ``.complete``); never a half-built venv used: a
``.building-*`` left by a killed build and a ``venv`` that is not ready are removed first, and a build that
raises leaves nothing (its exception propagates). A venv's python run from the ``.building-PID`` path finds
its own site-packages there (``pyvenv.cfg`` is looked up beside the python it runs as), so ``build`` can check
its imports before the rename.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import os
import shutil
import time
from pathlib import Path
from typing import Callable, IO


def complete(venv: Path) -> bool:
    return (venv / ".complete").is_file()


def build_once(venv: Path, build: Callable[[Path], str], *, ready: Callable[[Path], bool] = complete,
               wait_s: float | None = None) -> Path:
    """``venv``, built by ``build(building)`` (which returns the text for ``.complete``) unless ``ready(venv)``."""
    if ready(venv):
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        _take(lock, wait_s)
        if ready(venv):  # built by the one that held the lock before
            return venv
        for stale in venv.parent.glob(glob.escape(venv.name) + ".building-*"):  # a killed build's (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(venv, ignore_errors=True)  # incomplete or no longer usable
        building = venv.with_name(f"{venv.name}.building-{os.getpid()}")
        try:
            text = build(building)
            (building / ".complete").write_text(text)
            os.replace(building, venv)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return venv


def _take(lock: IO, wait_s: float | None) -> None:
    if wait_s is None:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return
    deadline = time.monotonic() + wait_s
    while True:  # another process may be building the same venv: wait for it (bounded)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(errno.ETIMEDOUT, f"another builder held the lock for more than {wait_s:g} s",
                                   lock.name) from None
            time.sleep(min(1.0, left))
