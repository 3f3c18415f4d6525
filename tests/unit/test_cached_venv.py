"""tests/support/cached_venv.py, the build-once of the cached venvs (vLLM, corner, transformers, GPU image), with
builds that only write files: racing builders build once, what a killed or failed build left is removed, and the
bounded wait for another builder's lock ends."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.cached_venv import build_once

REPO = Path(__file__).resolve().parents[2]

# A builder process: build_once(argv[1]) whose build waits until both builders looked for the venv before taking
# the lock (each `ready` call leaves a `checked-PID` file), so the second one must wait for the lock and find the
# first's venv there; each build appends a line to `builds`.
RACER = """
import os, sys, time
from pathlib import Path
from tests.support.cached_venv import build_once, complete
venv = Path(sys.argv[1])
def ready(v):
    (v.parent / f"checked-{os.getpid()}").touch()
    return complete(v)
def build(building):
    deadline = time.monotonic() + 30
    while len(list(venv.parent.glob("checked-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    with open(venv.parent / "builds", "a") as f:
        f.write(f"{os.getpid()}\\n")
    (building / "bin").mkdir(parents=True)
    return "built\\n"
print(build_once(venv, build, ready=ready))
"""


def _building(venv: Path) -> list[str]:
    return sorted(p.name for p in venv.parent.glob(venv.name + ".building-*"))


def _build(log: list):
    def build(building: Path) -> str:
        log.append(building.name)
        (building / "bin").mkdir(parents=True)
        (building / "bin" / "python").write_text("new\n")
        return "built\n"
    return build


def test_racing_builders_build_once(tmp_path):
    venv = tmp_path / "venv"
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(venv)], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [r.communicate(timeout=60) for r in racers]
    assert [r.returncode for r in racers] == [0, 0], results
    assert [out.strip() for out, _ in results] == [str(venv)] * 2
    assert len((tmp_path / "builds").read_text().splitlines()) == 1
    assert (venv / ".complete").read_text() == "built\n" and (venv / "bin").is_dir()
    assert _building(venv) == []


def test_ready_venv_is_returned_without_the_lock(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".complete").write_text("old\n")
    log = []
    assert build_once(venv, _build(log)) == venv
    assert log == [] and [p.name for p in tmp_path.iterdir()] == ["venv"]


def test_stale_build_and_incomplete_venv_are_replaced(tmp_path):
    venv = tmp_path / "venv"
    (tmp_path / "venv.building-123" / "bin").mkdir(parents=True)  # left by a killed build
    (venv / "bin").mkdir(parents=True)  # no .complete: a build that did not finish
    (venv / "bin" / "leftover").write_text("old\n")
    log = []
    assert build_once(venv, _build(log)) == venv
    assert len(log) == 1
    assert _building(venv) == []
    assert sorted(p.name for p in venv.rglob("*")) == [".complete", "bin", "python"]
    assert (venv / ".complete").read_text() == "built\n"


def test_failed_build_leaves_nothing_and_the_next_call_builds(tmp_path):
    venv = tmp_path / "venv"

    def broken(building: Path) -> str:
        (building / "bin").mkdir(parents=True)
        raise RuntimeError("pip could not install")

    with pytest.raises(RuntimeError, match="pip could not install"):
        build_once(venv, broken)
    assert not venv.exists() and _building(venv) == []
    log = []
    assert build_once(venv, _build(log)) == venv
    assert len(log) == 1 and (venv / ".complete").is_file()


def test_bounded_wait_for_another_builder(tmp_path):
    venv, lock = tmp_path / "venv", tmp_path / "venv.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'w'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(30)", str(lock)],
                              stdout=subprocess.PIPE, text=True)
    log = []
    try:
        assert holder.stdout.readline() == "held\n"
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="for more than 0.5 s") as e:
            build_once(venv, _build(log), wait_s=0.5)
        assert 0.5 <= time.monotonic() - t0 < 5
        assert e.value.filename == str(lock) and str(lock) in str(e.value)
        assert log == [] and not venv.exists()
    finally:
        holder.kill()
        holder.wait()
    assert build_once(venv, _build(log), wait_s=5) == venv and len(log) == 1  # the lock is free again
