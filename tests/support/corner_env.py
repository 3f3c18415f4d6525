"""The image's corner of the supported range, for CI's second run (``make test-corner``): a venv with Python
3.12, torch 2.11.0, megatron-core 0.19.2 and the newest DeepSpeed (the versions a current CUDA image has or
takes), beside the floor that ``make test`` runs in ``.venv`` (Python 3.11, torch 2.13, megatron-core 0.16.1).

The venv is built once and cached under ``$FBT_CORNER_ENVS`` (default ``~/.cache/fbt_megatron/corner-envs``),
keyed by :data:`PINS`, the project's other requirements (pyproject's dependencies and ``test`` extra) and the
interpreter's version, like tests/support/vllm_env.py's. fbt_megatron is not installed into it: the tests
run with the checkout on ``PYTHONPATH``, so the cache does not depend on the checkout. pip takes torch's CUDA
build for Python 3.12 from the registry (several GB); it runs on the CPU. A build runs in a
``.building-PID`` directory renamed into place only after ``import torch, megatron.core, deepspeed`` works.

    python -m tests.support.corner_env                 # build or find the venv; print its python and seconds
    python -m tests.support.corner_env --pytest ARGS   # run pytest ARGS in it on this checkout

Exit codes: pytest's, except that "no tests collected" (5) is a failure with its own sentence; 3 when the
venv cannot be built (no Python 3.12, no index, a pip error), saying why.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support.cached_venv import build_once
from tests.support.vllm_env import BuildTimeout, Unavailable, _clean_env, _run

# The image's corner. DeepSpeed: the newest release (`pip index versions deepspeed`); bump it here.
PINS = ["torch==2.11.0", "megatron-core==0.19.2", "deepspeed==0.19.8"]
PYTHON_VERSION = "3.12"
REPO = Path(__file__).resolve().parents[2]
NOT_COLLECTED = 5  # pytest's exit code when no test was collected


def root() -> Path:
    return Path(os.environ.get("FBT_CORNER_ENVS", Path.home() / ".cache" / "fbt_megatron" / "corner-envs"))


def _name(requirement: str) -> str:
    return canonicalize_name(Requirement(requirement).name)


def requirements(project: dict | None = None) -> list[str]:
    """The project's requirements and ``test`` extra without the pinned packages (they come from PINS)."""
    project = project or tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pinned = {_name(p) for p in PINS}
    wanted = [*project["dependencies"], *project.get("optional-dependencies", {}).get("test", [])]
    return [r for r in wanted if _name(r) not in pinned]


def _runs_as_wanted(python: str) -> bool:
    try:
        r = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                           text=True, timeout=60, env=_clean_env())
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0 and r.stdout.strip() == PYTHON_VERSION


def interpreter() -> Path:
    """A Python 3.12 that runs: ``$FBT_CORNER_PYTHON``, pyenv's, or ``python3.12`` on PATH (a pyenv shim on
    PATH may name a version it then refuses to run, so each candidate is tried)."""
    pyenv = sorted(glob.glob(str(Path.home() / ".pyenv" / "versions" / f"{PYTHON_VERSION}.*" / "bin" / "python")))
    candidates = [os.environ.get("FBT_CORNER_PYTHON"), *reversed(pyenv), shutil.which(f"python{PYTHON_VERSION}")]
    for candidate in filter(None, candidates):
        if _runs_as_wanted(candidate):
            return Path(candidate)
    raise Unavailable(f"no Python {PYTHON_VERSION} found that runs (tried {[c for c in candidates if c]}; "
                      "set FBT_CORNER_PYTHON to one)")


def venv_path(python: Path, reqs: list[str]) -> Path:
    version = subprocess.run([str(python), "-c", "import sys; print(sys.version)"], capture_output=True,
                             text=True, timeout=60, env=_clean_env(), check=True).stdout.strip()
    key = hashlib.sha256(repr((PINS, reqs, version)).encode()).hexdigest()[:12]
    return root() / f"py{PYTHON_VERSION}-{'-'.join(p.replace('==', '') for p in PINS)}-{key}"


def ensure(timeout: float = 2400) -> Path:
    """The corner venv's python (built on first use, then cached)."""
    python, reqs = interpreter(), requirements()
    venv = venv_path(python, reqs)
    ready = lambda v: (v / ".complete").is_file() and (v / "bin" / "python").exists()  # noqa: E731
    try:  # another build of the same venv: wait for it
        return build_once(venv, lambda building: _build(python, building, reqs, timeout), ready=ready) / "bin" / "python"
    except OSError as e:
        raise Unavailable(f"cannot build the corner venv: {e}") from None


def _build(python: Path, building: Path, reqs: list[str], timeout: float) -> str:
    """Installs into ``building``; returns ``.complete``'s text (the versions of torch, megatron-core, deepspeed)."""
    deadline = time.monotonic() + timeout
    left = lambda: max(1.0, deadline - time.monotonic())  # noqa: E731
    env = {**_clean_env(), "DS_BUILD_OPS": "0"}
    try:
        r = _run([str(python), "-m", "venv", str(building)], left(), env)
        if r.returncode != 0:
            raise Unavailable(f"python -m venv failed: {r.stderr.strip()[-1500:]}")
        pip = [str(building / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
               "--timeout", "60", "--retries", "2"]
        for step in (PINS[:1], [*PINS, *reqs]):  # torch first: DeepSpeed's setup imports it
            r = _run([*pip, *step], left(), env)
            if r.returncode != 0:
                raise Unavailable(f"pip could not install {' '.join(step)[:300]}: {r.stderr.strip()[-1500:]}")
        check = _run([str(building / "bin" / "python"), "-c",
                      "import torch, megatron.core, deepspeed; "
                      "print(torch.__version__, megatron.core.__version__, deepspeed.__version__)"], left(), env)
        if check.returncode != 0:
            raise Unavailable(f"the corner venv does not import: {(check.stdout + check.stderr).strip()[-1500:]}")
        return check.stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise Unavailable(f"cannot build the corner venv: {e}") from None


def pytest_in(python: Path, args: list[str]) -> int:
    """pytest ``args`` in the corner venv on this checkout; "nothing collected" is a failure."""
    env = {**_clean_env(), "PYTHONPATH": str(REPO)}
    code = subprocess.run([str(python), "-m", "pytest", *args], cwd=REPO, env=env).returncode
    if code == NOT_COLLECTED:
        print(f"corner: pytest collected no test from {' '.join(args)}: a failure, not a pass", flush=True)
        return 1
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    t0 = time.monotonic()
    try:
        python = ensure(float(os.environ.get("FBT_CORNER_SETUP_TIMEOUT", "2400")))
    except (Unavailable, BuildTimeout) as e:
        print(f"corner venv: not available ({time.monotonic() - t0:.0f} s): {e}", flush=True)
        return 3
    versions = (python.parent.parent / ".complete").read_text().strip()
    print(f"corner venv: {python} ready in {time.monotonic() - t0:.0f} s "
          f"(torch, megatron-core, deepspeed: {versions})", flush=True)
    if argv[:1] == ["--pytest"]:
        return pytest_in(python, argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
