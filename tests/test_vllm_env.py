"""tests/vllm_env.py, the vLLM venv of the serving tests, without building it: a build cut short by its time
limit is told apart from a package that cannot install (in CI the first fails the serving tests, the second
skips them), and `make test` builds the venv as a setup step before pytest (its own time limit), so a cold
machine does not skip the serving tests for time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import vllm_env

REPO = Path(__file__).resolve().parent.parent


def test_time_limit_is_build_timeout(tmp_path, monkeypatch):
    """A real build (in a fresh cache) with a 1 s limit: BuildTimeout, no venv left behind."""
    monkeypatch.setenv("FBT_VLLM_ENVS", str(tmp_path))
    monkeypatch.setenv("FBT_VLLM_BUILD_TIMEOUT", "1")
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
    """`python tests/vllm_env.py`: its own limit (FBT_VLLM_SETUP_TIMEOUT, default 2400 s, not the test-time 600 s),
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


def test_make_test_builds_the_venv_before_pytest():
    """`make test` runs the setup step (tests/vllm_env.py) before pytest."""
    out = subprocess.run(["make", "-n", "-C", str(REPO), "test", f"VENV={Path(sys.executable).parent.parent}"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    setup = [i for i, line in enumerate(out) if line.endswith("tests/vllm_env.py")]
    tests = [i for i, line in enumerate(out) if "-m pytest" in line]
    assert setup and tests and setup[0] < tests[0], out
