"""A stand-in for a CUDA image's Python on this CPU machine: Python 3.12 with torch 2.11 and nothing else,
for the test that installs the GPU check's wheelhouse offline (tests/integration/test_gpu_wheels.py).

``torch_env()`` builds, once, a venv holding ``torch==2.11.0`` alone (pip takes the CUDA build: several GB,
fast again from pip's cache), cached under ``$FBT_GPU_IMAGE_ENVS`` (default
``~/.cache/fbt_megatron/gpu-image-envs``) and renamed into place only after ``import torch`` works there;
builders take turns on a lock file. ``fresh_env(path)`` makes a new, empty venv that sees that torch through a
``.pth`` file, as an image's Python sees its own torch: each test installs into a clean environment without
copying torch. ``Unavailable`` says why an environment cannot be built (no Python 3.12, no registry).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

try:
    from tests.support.cached_venv import build_once
except ModuleNotFoundError:  # run as a script (`python tests/support/gpu_image_env.py`): this folder is on sys.path
    from cached_venv import build_once

TORCH = "torch==2.11.0"
PYTHON_VERSION = "3.12"


class Unavailable(RuntimeError):
    """The environment cannot be built here (the message says why)."""


def python312() -> str:
    """A Python 3.12 interpreter: ``$FBT_PYTHON312``, ``python3.12`` on PATH or pyenv's."""
    candidates = [os.environ.get("FBT_PYTHON312"), shutil.which("python3.12"),
                  *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12.*/bin/python")), reverse=True)]
    for candidate in filter(None, candidates):
        r = subprocess.run([candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                           capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip() == PYTHON_VERSION:
            return candidate
    raise Unavailable("no Python 3.12 here (set FBT_PYTHON312, or install it with pyenv)")


def root() -> Path:
    return Path(os.environ.get("FBT_GPU_IMAGE_ENVS", Path.home() / ".cache" / "fbt_megatron" / "gpu-image-envs"))


def _site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{PYTHON_VERSION}" / "site-packages"


def _run(cmd: list, timeout: float = 1800) -> None:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        tail = " | ".join((r.stdout + r.stderr).strip().splitlines()[-3:])
        raise Unavailable(f"{' '.join(map(str, cmd[:4]))} ... exited {r.returncode}: {tail}")


def torch_env() -> Path:
    """The cached venv holding torch alone (built on first use); returns its directory."""
    return build_once(root() / f"py{PYTHON_VERSION}-{TORCH.replace('==', '-')}", _build)


def _build(building: Path) -> str:
    """Installs into ``building`` (its bin/python finds its site-packages there); returns ``.complete``'s text."""
    _run([python312(), "-m", "venv", building])
    _run([building / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check", TORCH])
    _run([building / "bin" / "python", "-c", "import torch"])
    return TORCH + "\n"


def fresh_env(path: Path) -> Path:
    """A new venv at ``path`` (pip included) that imports the cached torch; returns its python."""
    torch_site = _site_packages(torch_env())
    _run([python312(), "-m", "venv", path])
    (_site_packages(path) / "image_torch.pth").write_text(f"{torch_site}\n")
    return path / "bin" / "python"


if __name__ == "__main__":
    print(torch_env())
    sys.exit(0)
