"""CI's second corner (tests/support/corner_env.py): its venv takes the pinned versions from PINS and every
other requirement from pyproject.toml, and a run that collects nothing fails instead of passing."""

import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.support import corner_env


def test_the_pins_replace_the_projects_ranges_and_lie_inside_them():
    names = [corner_env._name(r) for r in corner_env.requirements()]
    assert not {"torch", "megatron-core", "deepspeed"} & set(names)  # from PINS, not resolved again
    assert {"pytest", "pydantic", "webdataset"} <= set(names)
    project = corner_env.tomllib.loads((corner_env.REPO / "pyproject.toml").read_text())["project"]
    ranges = {corner_env._name(r): Requirement(r).specifier for r in project["dependencies"]}
    for pin in corner_env.PINS:
        req = Requirement(pin)
        assert Version(str(req.specifier).lstrip("=")) in ranges[corner_env._name(pin)], pin


def test_nothing_collected_is_a_failure(tmp_path, capsys):
    (tmp_path / "conftest.py").write_text("")
    assert corner_env.pytest_in(Path(sys.executable), ["-q", "-p", "no:cacheprovider", str(tmp_path)]) == 1
    assert "collected no test" in capsys.readouterr().out


def test_an_interpreter_that_does_not_run_is_passed_over(tmp_path, monkeypatch):
    """A pyenv shim on PATH names python3.12 and then refuses to run it: the corner must not pick it."""
    shim = tmp_path / "python3.12"
    shim.write_text("#!/bin/sh\necho 'pyenv: python3.12: command not found' >&2\nexit 127\n")
    shim.chmod(0o755)
    monkeypatch.setattr(corner_env.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(corner_env.shutil, "which", lambda name: str(shim))
    monkeypatch.setenv("FBT_CORNER_PYTHON", sys.executable)  # this test's Python: not 3.12 on the floor
    if corner_env._runs_as_wanted(sys.executable):
        assert corner_env.interpreter() == Path(sys.executable)
        return
    with pytest.raises(corner_env.Unavailable, match="no Python 3.12 found that runs"):
        corner_env.interpreter()
