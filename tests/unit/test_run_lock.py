"""One run per run directory: a second live run refuses before touching anything; a stale lock (its
process gone, an earlier start of the same job) is taken over with a warning."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fbt_megatron.train.run_lock import LOCK_NAME, RunDirLocked, RunLock, stale_reason

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["data.source=synthetic", "train.steps=2", "checkpoint.every=1000", "eval.at_end=false",
         "logging.tensorboard=false"]


def _holder(run_dir: Path) -> subprocess.Popen:
    """Another process that takes the lock and keeps it."""
    code = ("import sys, time; from fbt_megatron.train.run_lock import RunLock; RunLock(sys.argv[1]).acquire(); "
            "print('locked', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.stdout.readline().strip() == "locked"
    return proc


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.slow  # a lock-holder process
def test_second_live_run_refuses_and_loses_nothing(tmp_path, single_process):
    from fbt_megatron.recipe import load_recipe
    from fbt_megatron.train.run import train

    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    try:
        # the first run's state: a published step and a save in flight
        ckpts = run_dir / "checkpoints"
        (ckpts / "step_00000006").mkdir(parents=True)
        (ckpts / "step_00000008.tmp" / "weights").mkdir(parents=True)
        (ckpts / "latest").write_text("step_00000006\n")
        before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
        recipe = load_recipe(ROOT / "recipes" / "tiny.yaml", [*SHORT, f"run_dir={run_dir}"])
        with pytest.raises(RunDirLocked) as e:
            train(recipe)
        msg = str(e.value)
        assert f"host {socket.gethostname()}" in msg and f"pid {holder.pid}" in msg and str(run_dir / LOCK_NAME) in msg
        assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before
        assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()

    # the holder is gone: its lock is stale, taken over with a warning, and released at the end
    records = _Records()
    logging.getLogger("fbt_megatron.train.run_lock").addHandler(records)
    try:
        fresh = tmp_path / "fresh"
        dead = _holder(fresh)
        dead.kill()
        dead.wait()
        summary = train(load_recipe(ROOT / "recipes" / "tiny.yaml", [*SHORT, f"run_dir={fresh}"])).summary()
    finally:
        logging.getLogger("fbt_megatron.train.run_lock").removeHandler(records)
    assert summary["step"] == 2
    assert any(f"process {dead.pid} on {socket.gethostname()} no longer exists" in m for m in records.messages), records.messages
    assert not (fresh / LOCK_NAME).exists()


def test_stale_rules():
    me = {"host": "node-b", "pid": 10, "slurm_job": "77", "torchrun_id": "abc"}
    # another host: the process cannot be checked; the same job id means an earlier start of this job
    assert "earlier start of this SLURM job" in stale_reason({"host": "node-a", "pid": 5, "slurm_job": "77"}, me)
    assert "earlier attempt of this torchrun run" in stale_reason({"host": "node-a", "pid": 5, "torchrun_id": "abc"}, me)
    assert stale_reason({"host": "node-a", "pid": 5, "torchrun_id": "none"}, dict(me, torchrun_id="none")) is None
    assert stale_reason({"host": "node-a", "pid": 5}, me) is None  # unknown: kept
    # this host: a live process keeps it (even with the same torchrun id "none"), a reused pid does not
    here = {"host": socket.gethostname(), "pid": -1, "torchrun_id": "none"}
    from fbt_megatron.train.run_lock import _start_time

    parent = os.getppid()
    live = {"host": socket.gethostname(), "pid": parent, "pid_started": _start_time(parent), "torchrun_id": "none"}
    assert stale_reason(live, here) is None
    assert "now belongs to another process" in stale_reason(dict(live, pid_started=live["pid_started"] - 100), here)
    # pid 1 is a run too (a container's main process): alive, kept
    assert stale_reason({"host": socket.gethostname(), "pid": 1, "pid_started": _start_time(1)},
                        dict(here, pid=os.getpid())) is None
    # a lock on this host that names no valid pid (written by hand, or not by a run): stale, not a crash
    for bad in ({}, {"pid": -1}, {"pid": 0}, {"pid": "123"}, {"pid": None}):
        reason = stale_reason({"host": socket.gethostname(), **bad}, dict(here, pid=os.getpid()))
        assert reason.startswith(f"it names no process (pid {bad.get('pid')!r})"), (bad, reason)


def test_unreadable_fresh_lock_is_waited_for_then_taken_when_old(tmp_path):
    lock_file = tmp_path / LOCK_NAME
    lock_file.write_text("{\"host\": ")  # cut while being written
    old = time.time() - 60
    os.utime(lock_file, (old, old))
    with RunLock(tmp_path) as lock:
        assert json.loads(lock_file.read_text())["pid"] == os.getpid() and lock.held
    assert not lock_file.exists()


def test_a_lock_being_written_is_waited_for_not_taken(tmp_path):
    """A run that just created ``run.lock`` and is still writing it (unreadable, seconds old) holds the
    run directory: a second run waits for the content and then refuses; it does not take the lock over."""
    import threading

    from fbt_megatron.train.run_lock import _start_time

    lock_file = tmp_path / LOCK_NAME
    lock_file.write_text("{\"host\": ")  # created by the other run a moment ago, not yet complete
    parent = os.getppid()  # a live process on this host: the other run
    live = {"host": socket.gethostname(), "pid": parent, "pid_started": _start_time(parent), "locked_at": time.time()}

    def finish_writing():
        time.sleep(0.6)
        lock_file.write_text(json.dumps(live))

    writer = threading.Thread(target=finish_writing)
    writer.start()
    try:
        with pytest.raises(RunDirLocked, match=f"in use by another run \\(host {socket.gethostname()}, pid {parent}"):
            RunLock(tmp_path).acquire()
    finally:
        writer.join()
    assert json.loads(lock_file.read_text()) == live  # the other run's lock, untouched


@pytest.mark.slow  # a lock-holder process
def test_two_takers_of_one_stale_lock_cannot_both_win(tmp_path, monkeypatch):
    """B judged a dead run's lock stale; before B removes it, A takes it over and holds it. B must not
    remove A's fresh lock: it re-reads the holder under the takers' guard and refuses."""
    import fbt_megatron.train.run_lock as run_lock

    lock_file = tmp_path / LOCK_NAME
    dead = {"host": socket.gethostname(), "pid": 2 ** 22 + 7, "pid_started": 1.0, "locked_at": time.time()}
    lock_file.write_text(json.dumps(dead))
    a_holder = None
    real = run_lock.RunLock._remove_if_unchanged

    def a_takes_it_first(self, stale):
        nonlocal a_holder
        if a_holder is None:  # A runs its whole takeover between B's judgement and B's removal
            a_holder = _holder(tmp_path)
        return real(self, stale)

    monkeypatch.setattr(run_lock.RunLock, "_remove_if_unchanged", a_takes_it_first)
    records = _Records()
    logging.getLogger("fbt_megatron.train.run_lock").addHandler(records)
    try:
        with pytest.raises(RunDirLocked, match="in use by another run"):
            RunLock(tmp_path).acquire()
        assert json.loads(lock_file.read_text())["pid"] == a_holder.pid  # A's lock survived
        assert records.messages == []  # B took nothing over
    finally:
        logging.getLogger("fbt_megatron.train.run_lock").removeHandler(records)
        if a_holder is not None:
            a_holder.kill()
            a_holder.wait()


def _train_when_rank0_cannot_lock(recipe_data: dict) -> str:
    import fbt_megatron.train.run_lock as run_lock
    from tests.support.training import train_fn

    def fail(self):
        raise PermissionError(13, "Permission denied", str(self.path))

    run_lock.RunLock.acquire = fail
    t0 = time.time()
    try:
        train_fn(recipe_data)
    except RunDirLocked as e:
        return f"{time.time() - t0:.1f}s {e}"
    return "trained"


@pytest.mark.slow  # two gloo processes
def test_a_lock_error_on_rank0_reaches_every_rank_at_once(tmp_path):
    """Not only a held lock: any failure to take it (here a permission error) is broadcast, so the
    other ranks report the cause instead of waiting in a collective until its timeout."""
    from tests.support.distributed import run_distributed
    from tests.support.training import tiny_recipe

    out = run_distributed(_train_when_rank0_cannot_lock, 2, tiny_recipe(tmp_path / "run"), timeout=300)
    for rank in (0, 1):
        seconds, message = out[rank].split(" ", 1)
        assert "cannot take the run-directory lock" in message and "PermissionError" in message, out[rank]
        assert float(seconds.rstrip("s")) < 60, out[rank]


def _live_holder() -> dict:
    """The lock content of a live process on this host (the test's parent) other than this one."""
    from fbt_megatron.train.run_lock import _start_time

    parent = os.getppid()
    return {"host": socket.gethostname(), "pid": parent, "pid_started": _start_time(parent), "locked_at": time.time()}


def test_a_holders_slurm_job_decides_on_another_host(monkeypatch):
    """A lock from another host whose holder ran in SLURM job J (not this job): stale once squeue says J is
    no longer running, kept while it runs or while squeue cannot tell."""
    import fbt_megatron.train.run_lock as run_lock

    me = {"host": "node-b", "pid": 10, "slurm_job": "77"}
    holder = {"host": "node-a", "pid": 5, "slurm_job": "55"}
    for running, stale in [(False, True), (True, False), (None, False)]:
        asked = []
        monkeypatch.setattr(run_lock, "_slurm_job_running", lambda job: asked.append(job) or running)
        reason = stale_reason(holder, me)
        assert asked == ["55"] and (reason == "its SLURM job 55 is no longer running" if stale else reason is None), \
            (running, reason)


def test_squeue_answers_are_read_as_running_finished_or_unknown(tmp_path, monkeypatch):
    """_slurm_job_running through a stand-in squeue: a running state -> True; no line (finished, purged)
    or 'Invalid job id' -> False; any other squeue failure -> None (unknown: the lock is kept)."""
    from fbt_megatron.train.run_lock import _slurm_job_running

    squeue = tmp_path / "bin" / "squeue"
    squeue.parent.mkdir()
    monkeypatch.setenv("PATH", f"{squeue.parent}:{os.environ['PATH']}")
    for out, err, code, want in [("RUNNING\n", "", 0, True), ("COMPLETING\n", "", 0, True), ("", "", 0, False),
                                 ("PENDING\n", "", 0, False),
                                 ("", "slurm_load_jobs error: Invalid job id specified", 1, False),
                                 ("", "slurm_load_jobs error: Unable to contact slurm controller", 1, None)]:
        squeue.write_text(f"#!/bin/sh\nprintf '{out}'\nprintf '{err}' >&2\nexit {code}\n")
        squeue.chmod(0o755)
        assert _slurm_job_running("55") is want, (out, err, code)
    import fbt_megatron.train.run_lock as run_lock

    def cannot_start(*args, **kwargs):  # found on PATH, but cannot start (e.g. a broken install)
        raise PermissionError(13, "Permission denied", "squeue")

    monkeypatch.setattr(run_lock.subprocess, "run", cannot_start)
    assert _slurm_job_running("55") is None


def test_takeover_warning_names_the_stale_holder_and_why(tmp_path):
    records = _Records()
    logging.getLogger("fbt_megatron.train.run_lock").addHandler(records)
    try:
        dead = {"host": socket.gethostname(), "pid": 2 ** 22 + 7, "pid_started": 1.0, "slurm_job": "55"}
        (tmp_path / LOCK_NAME).write_text(json.dumps(dead))
        RunLock(tmp_path).acquire().release()
        (tmp_path / LOCK_NAME).write_text("{\"host\": ")
        old = time.time() - 60
        os.utime(tmp_path / LOCK_NAME, (old, old))
        RunLock(tmp_path).acquire().release()
    finally:
        logging.getLogger("fbt_megatron.train.run_lock").removeHandler(records)
    host = socket.gethostname()
    assert records.messages == [
        f"taking over the lock {tmp_path / LOCK_NAME} of host {host}, pid {2 ** 22 + 7}, SLURM job 55: "
        f"process {2 ** 22 + 7} on {host} no longer exists",
        f"taking over the lock {tmp_path / LOCK_NAME} of an unknown run: it is unreadable and 60 s old "
        "(a crash while writing it)"], records.messages


def test_lock_in_a_new_run_directory_readable_by_others(tmp_path):
    """The run directory (and its parents) is created; the lock file is rw-r--r-- (under umask 022)."""
    umask = os.umask(0o022)
    try:
        with RunLock(tmp_path / "a" / "b") as lock:
            assert lock.path.stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(umask)


def test_release_removes_only_the_lock_this_object_holds(tmp_path):
    """A RunLock that never acquired, or already released, removes nothing: not this process's newer lock,
    not another run's lock that took the directory over."""
    first = RunLock(tmp_path).acquire()
    RunLock(tmp_path).release()  # never acquired
    assert first.path.exists() and first.held
    first.release()
    assert not first.path.exists() and not first.held
    second = RunLock(tmp_path).acquire()
    first.release()  # released before
    assert second.path.exists()
    second.path.write_text(json.dumps(_live_holder()))  # another run's lock (taken over meanwhile)
    second.release()
    assert json.loads(second.path.read_text())["pid"] == os.getppid()


def test_a_lock_released_while_judged_is_simply_created(tmp_path, monkeypatch):
    """The lock file exists when this run tries to create its own, and is gone when it reads it (or when it
    is about to remove it as stale): the holder released it in between. The run then creates its own, with
    no takeover warning."""
    import fbt_megatron.train.run_lock as run_lock

    records = _Records()
    logging.getLogger("fbt_megatron.train.run_lock").addHandler(records)
    try:
        lock_file = tmp_path / LOCK_NAME
        real_read = run_lock.RunLock._read

        def released_before_read(self):
            if lock_file.exists() and not getattr(self, "_seen", False):
                self._seen = True
                lock_file.unlink()  # the holder releases it just now
            return real_read(self)

        lock_file.write_text(json.dumps(_live_holder()))
        monkeypatch.setattr(run_lock.RunLock, "_read", released_before_read)
        with RunLock(tmp_path) as lock:
            assert json.loads(lock_file.read_text())["pid"] == os.getpid() and lock.held
        monkeypatch.undo()

        real_remove = run_lock.RunLock._remove_if_unchanged

        def released_before_removal(self, stale):
            lock_file.unlink(missing_ok=True)
            return real_remove(self, stale)

        lock_file.write_text(json.dumps({"host": socket.gethostname(), "pid": 2 ** 22 + 7, "pid_started": 1.0}))
        monkeypatch.setattr(run_lock.RunLock, "_remove_if_unchanged", released_before_removal)
        with RunLock(tmp_path) as lock:
            assert json.loads(lock_file.read_text())["pid"] == os.getpid() and lock.held
    finally:
        logging.getLogger("fbt_megatron.train.run_lock").removeHandler(records)
    assert records.messages == []


def test_a_stale_lock_being_replaced_by_another_taker_is_not_removed(tmp_path, monkeypatch):
    """B judged a dead run's lock stale; before B removes it, another taker has removed it and is writing its
    own (unreadable for a moment). B must not remove that one: it waits for it and refuses."""
    import threading

    import fbt_megatron.train.run_lock as run_lock

    lock_file = tmp_path / LOCK_NAME
    lock_file.write_text(json.dumps({"host": socket.gethostname(), "pid": 2 ** 22 + 7, "pid_started": 1.0}))
    live = _live_holder()
    real_remove = run_lock.RunLock._remove_if_unchanged
    writer = threading.Thread(target=lambda: (time.sleep(0.6), lock_file.write_text(json.dumps(live))))

    def another_taker_first(self, stale):
        if writer.ident is None:
            lock_file.write_text("{\"host\": ")  # the other taker's lock, being written
            writer.start()
        return real_remove(self, stale)

    monkeypatch.setattr(run_lock.RunLock, "_remove_if_unchanged", another_taker_first)
    try:
        with pytest.raises(RunDirLocked, match="in use by another run"):
            RunLock(tmp_path).acquire()
    finally:
        if writer.ident:
            writer.join()
    assert json.loads(lock_file.read_text()) == live


class _Clock:
    """run_lock's ``time``: a clock at ``now`` that sleep advances instead of waiting."""

    def __init__(self, now: float):
        self.now, self.slept = now, 0.0

    def time(self):
        return self.now + self.slept

    def sleep(self, seconds):
        self.slept += seconds

    def __getattr__(self, name):
        return getattr(time, name)


@pytest.mark.parametrize("age,waits", [(9.5, True), (10.0, False), (10.5, False)])
def test_an_unreadable_lock_is_waited_for_until_it_is_10_s_old(tmp_path, monkeypatch, age, waits):
    import fbt_megatron.train.run_lock as run_lock

    lock_file = tmp_path / LOCK_NAME
    lock_file.write_text("{\"host\": ")
    clock = _Clock(lock_file.stat().st_mtime + age)
    monkeypatch.setattr(run_lock, "time", clock)
    with RunLock(tmp_path) as lock:
        assert lock.held
    assert (0.4 <= clock.slept <= 1.0) if waits else clock.slept == 0, clock.slept
