"""tests/support/vllm_env.py, the vLLM venv of the serving tests, without building it: a build cut short by its time
limit is told apart from a package that cannot install (in CI the first fails the serving tests, the second
skips them), and `make test` builds the venv as a setup step before pytest (its own time limit), so a cold
machine does not skip the serving tests for time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import vllm_env

REPO = Path(__file__).resolve().parents[2]


def test_time_limit_is_build_timeout(tmp_path, monkeypatch):
    """A real build (in a fresh cache) with a 1 s limit: BuildTimeout, no venv left behind."""
    monkeypatch.setenv("FBT_VLLM_ENVS", str(tmp_path))
    monkeypatch.setenv("FBT_VLLM_BUILD_TIMEOUT", "1")
    monkeypatch.delenv(vllm_env.SETUP_TIMED_OUT, raising=False)  # set by `make test` after a setup timeout
    with pytest.raises(vllm_env.BuildTimeout, match="did not finish within"):
        vllm_env.ensure()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_ci_fails_on_time_skips_on_install(monkeypatch):
    timeout, broken = vllm_env.BuildTimeout("pip ... did not finish"), vllm_env.Unavailable("pip: no index")
    monkeypatch.setenv("CI", "true")
    assert vllm_env.skip_or_fail(timeout)[0] == "fail"
    assert vllm_env.skip_or_fail(broken) == ("skip", "vLLM's CPU build is not available here: pip: no index")
    monkeypatch.delenv("CI")
    assert vllm_env.skip_or_fail(timeout)[0] == "skip"
    assert vllm_env.skip_or_fail(broken)[0] == "skip"


@pytest.mark.parametrize("outcome, code", [("built", 0), ("cannot install", 0), ("timeout", 1)])
def test_setup_step(outcome, code, monkeypatch, capsys):
    """`python tests/support/vllm_env.py`: its own limit (FBT_VLLM_SETUP_TIMEOUT, default 2400 s, not the test-time 600 s),
    the seconds printed; exit 1 only when the build ran out of time."""
    monkeypatch.delenv("FBT_VLLM_SETUP_TIMEOUT", raising=False)
    monkeypatch.setenv("FBT_VLLM_BUILD_TIMEOUT", "600")
    seen = []

    def ensure():
        seen.append(vllm_env.build_timeout())
        if outcome == "timeout":
            raise vllm_env.BuildTimeout("did not finish within 2400 s")
        if outcome == "cannot install":
            raise vllm_env.Unavailable("pip could not install")
        return Path("/venv/bin/python")

    monkeypatch.setattr(vllm_env, "ensure", ensure)
    assert vllm_env.main() == code
    assert seen == [2400.0]
    out = capsys.readouterr().out
    assert {"built": "ready in", "cannot install": "will skip", "timeout": "ran out of time"}[outcome] in out


def _fake_venv(tmp_path, setup_code: int, pytest_code: int) -> Path:
    """A venv whose python logs each call (its arguments and FBT_VLLM_SETUP_TIMED_OUT) and exits with
    ``setup_code`` for the setup step, ``pytest_code`` for pytest, 0 otherwise (the embedded data's build)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls.log"
    (venv / "bin" / "python").write_text(
        "#!/bin/sh\n"
        f'echo "$* | ${{FBT_VLLM_SETUP_TIMED_OUT:-}}" >> {log}\n'
        f'case "$1 $2" in tests/support/vllm_env.py*) exit {setup_code};; "-m pytest") exit {pytest_code};; esac\nexit 0\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".fbt-installed").touch()  # newer than pyproject.toml: make does not reinstall
    return venv


@pytest.mark.parametrize("setup_code, pytest_code, make_fails", [(0, 0, False), (0, 3, True), (1, 0, True), (1, 3, True),
                                                                  (2, 0, True)])
def test_make_test_runs_pytest_after_the_setup_step_whatever_it_gave(tmp_path, setup_code, pytest_code, make_fails):
    """`make test` runs the setup step (tests/support/vllm_env.py), builds the embedded data, then runs pytest on
    two workers whatever the step gave; a timeout (exit 1) is told to pytest (the serving tests report it
    instead of building again), nothing else is (an inherited flag is cleared); the target fails if either did."""
    venv = _fake_venv(tmp_path, setup_code, pytest_code)
    env = dict(os.environ, FBT_VLLM_SETUP_TIMED_OUT="inherited")  # as inside a `make test` after a timeout
    r = subprocess.run(["make", "-s", "-C", str(REPO), "test", f"VENV={venv}"], capture_output=True, text=True, env=env)
    assert (r.returncode != 0) == make_fails, (r.returncode, r.stdout, r.stderr)
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert [c.split(" | ")[0] for c in calls] == ["tests/support/vllm_env.py",
                                                   "-m fbt_megatron.cli data embedded --out data/embedded",
                                                   "-m pytest -q -n 2 --dist loadgroup tests"], calls
    timed_out = calls[2].split(" | ")[1]
    assert bool(timed_out) == (setup_code == 1), calls


def test_setup_timed_out_is_reported_without_a_second_build(tmp_path, monkeypatch):
    """With FBT_VLLM_SETUP_TIMED_OUT set (by `make test`), ensure() raises BuildTimeout naming the setup step
    and starts no build (nothing is written to the cache); in CI the serving tests then fail."""
    monkeypatch.setenv("FBT_VLLM_ENVS", str(tmp_path / "envs"))
    monkeypatch.setenv(vllm_env.SETUP_TIMED_OUT, "exit 1, see its output above")
    with pytest.raises(vllm_env.BuildTimeout, match="setup step .* ran out of time: exit 1"):
        vllm_env.ensure()
    assert not (tmp_path / "envs").exists()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(vllm_env.BuildTimeout) as e:
        vllm_env.ensure()
    assert vllm_env.skip_or_fail(e.value)[0] == "fail"
