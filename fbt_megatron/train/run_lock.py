"""One run per run directory: a lock file ``<run_dir>/run.lock`` held by rank 0 while it trains.

Two runs on one ``run_dir`` (``fbt slurm submit`` twice on a recipe, a second ``fbt train`` in another
terminal) would destroy each other's checkpoints: the second removes the first's in-flight
``step_N.tmp`` and prunes its newer steps. The lock records who holds it (host, pid and the pid's start
time, SLURM job id, torchrun run id); a second run finds it and stops with an error naming the holder,
before it touches anything.

A lock left behind by a run that is gone is taken over, with a warning saying why it was judged stale:
- the holder ran on this host and its process no longer exists (or the pid now belongs to another
  process: the start time differs);
- the holder ran on another host and was an earlier incarnation of this very job: the same SLURM job
  id (a requeued job), or the same torchrun run id (an elastic restart);
- the holder's SLURM job is no longer running (``squeue`` knows it as finished, or not at all).
A lock from another host with no way to check it is kept: remove ``run.lock`` by hand once you are
sure that run has ended.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from fbt_megatron.errors import UserError

LOCK_NAME = "run.lock"
log = logging.getLogger(__name__)


class RunDirLocked(UserError, RuntimeError):
    """Another live run holds the run directory."""


def _start_time(pid: int) -> float | None:
    import psutil

    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):  # (ZombieProcess is a NoSuchProcess)
        return None


def _identity() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "pid_started": _start_time(pid),
            "slurm_job": os.environ.get("SLURM_JOB_ID"), "torchrun_id": os.environ.get("TORCHELASTIC_RUN_ID"),
            "locked_at": time.time()}


def _slurm_job_running(job_id: str) -> bool | None:
    """True/False when squeue can tell, None when it cannot (no SLURM here)."""
    if shutil.which("squeue") is None:
        return None
    try:
        r = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode and "Invalid job id" not in r.stderr:
        return None
    states = r.stdout.split()
    return any(s in ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED") for s in states)


def stale_reason(holder: dict, me: dict | None = None) -> str | None:
    """Why ``holder``'s lock is stale, or None while its run may still be alive."""
    me = me or _identity()
    if holder.get("host") == me["host"]:  # the process itself can be checked
        pid = holder.get("pid")
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:  # (psutil refuses it: ValueError)
            return f"it names no process (pid {pid!r}): no run of this host holds it"
        if pid == me["pid"]:
            return "it was left by this process (a previous run in it did not release it)"
        started = _start_time(pid)
        if started is None:
            return f"process {pid} on {me['host']} no longer exists"
        if holder.get("pid_started") is not None and abs(started - float(holder["pid_started"])) > 1.0:
            return f"pid {pid} on {me['host']} now belongs to another process"
        return None  # alive
    if holder.get("slurm_job") and holder["slurm_job"] == me.get("slurm_job"):
        return f"it was taken by an earlier start of this SLURM job ({holder['slurm_job']}, requeued)"
    run_id = holder.get("torchrun_id")
    if run_id and run_id not in ("none", "default") and run_id == me.get("torchrun_id"):
        return f"it was taken by an earlier attempt of this torchrun run ({run_id}, restarted)"
    if holder.get("slurm_job"):
        if _slurm_job_running(str(holder["slurm_job"])) is False:
            return f"its SLURM job {holder['slurm_job']} is no longer running"
    return None


def _describe(holder: dict) -> str:
    parts = [f"host {holder.get('host', '?')}", f"pid {holder.get('pid', '?')}"]
    if holder.get("slurm_job"):
        parts.append(f"SLURM job {holder['slurm_job']}")
    if holder.get("locked_at"):
        parts.append("since " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder["locked_at"]))))
    return ", ".join(parts)


class RunLock:
    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_NAME
        self.held = False

    def _read(self) -> dict | None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError:  # being written right now, or cut by a crash
            age = time.time() - self.path.stat().st_mtime if self.path.exists() else 0
            return {"unreadable": True, "age": age}

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = _identity()
        for _ in range(50):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read()
                if holder is None:
                    continue  # released in between: try again
                if holder.get("unreadable"):
                    if holder["age"] < 10:
                        time.sleep(0.2)
                        continue
                    reason = f"it is unreadable and {holder['age']:.0f} s old (a crash while writing it)"
                else:
                    reason = stale_reason(holder, me)
                if reason is None:
                    raise RunDirLocked(
                        f"{self.path.parent} is in use by another run ({_describe(holder)}): two runs on one "
                        f"run_dir would delete each other's checkpoints. Choose another run_dir, or wait for "
                        f"that run to end; if it has ended, remove {self.path}")
                if self._remove_if_unchanged(holder):
                    log.warning("taking over the lock %s of %s: %s", self.path,
                                _describe(holder) if not holder.get("unreadable") else "an unknown run", reason)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            return self
        raise RunDirLocked(f"could not take the lock {self.path}: it keeps changing hands")

    def _remove_if_unchanged(self, stale: dict) -> bool:
        """Remove the lock judged stale, unless it changed hands meanwhile. Takers serialise on an
        flock of a side file, so two runs that both judged the same lock stale cannot both remove it
        (the second re-reads the first's fresh lock and refuses)."""
        import fcntl

        with open(self.path.with_name(LOCK_NAME + ".guard"), "a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            try:
                now = self._read()
                if now is None:
                    return False  # released meanwhile: try to create it
                same = (now.get("unreadable") and stale.get("unreadable")) or now == stale
                if not same:
                    return False  # another taker won: the caller re-reads and judges the new holder
                self.path.unlink(missing_ok=True)
                return True
            finally:
                fcntl.flock(guard, fcntl.LOCK_UN)

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        holder = self._read()
        if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
