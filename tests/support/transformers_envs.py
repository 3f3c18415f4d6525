"""Python environments with another transformers version, for the export's compatibility tests.

Each is a venv holding only transformers (and the tokenizers / huggingface-hub that version needs, when
the running environment's do not fit it); everything else (torch, safetensors, numpy, ...) is borrowed
from the running environment through a .pth line, which adds that site-packages directory after the
venv's own (so the venv's transformers wins) and without processing its .pth files (so the editable
checkout stays invisible). Built once and cached under ``$FBT_TRANSFORMERS_ENVS`` (default
``~/.cache/fbt_megatron/transformers-envs``), keyed by the version, the pins, this Python and the
borrowed directory: a clean clone builds each in a few seconds from the package index, later runs
reuse it. ``ensure(version)`` returns the venv's python or raises ``Unavailable`` with the reason
(e.g. no package index reachable).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from tests.support.cached_venv import build_once

# The oldest supported version, the first 5.x and the last one that names the cache `past_key_values`
# (5.24, which calls it `cache`, is the running environment's). Pins: what each needs that the running
# environment (tokenizers 0.23.3, huggingface-hub 2.x, and since transformers 5.25 the `kernels` package
# it requires) does not satisfy. transformers 5.0.0 builds kernels' LayerRepository at import without a
# revision, which kernels refuses since 0.15 ("Either a revision or a version must be specified").
VERSIONS = {
    "4.57.6": ["tokenizers>=0.22,<=0.23.0", "huggingface-hub>=0.34,<1.0"],
    "5.0.0": ["tokenizers>=0.22,<=0.23.0", "huggingface-hub>=1.3,<2.0", "typer-slim", "httpx", "httpcore",
              "kernels>=0.9,<0.15"],
    "5.23.0": [],
}


# How long a builder waits for another builder of the same venv (pytest-xdist workers take turns): longer than
# a build's own limits (pip 900 s, venv and import check 300 s each), so a longer wait is a hung builder.
LOCK_WAIT_S = 1800


class Unavailable(RuntimeError):
    """The environment cannot be built here (the message says why)."""


def root() -> Path:
    return Path(os.environ.get("FBT_TRANSFORMERS_ENVS", Path.home() / ".cache" / "fbt_megatron" / "transformers-envs"))


def ensure(version: str) -> Path:
    """The python of a venv with ``transformers==version`` (built on first use, then cached)."""
    pins = VERSIONS[version]
    borrowed = sysconfig.get_paths()["purelib"]
    key = hashlib.sha256(repr((version, pins, sys.version, borrowed)).encode()).hexdigest()[:12]
    venv = root() / f"transformers-{version}-{key}"
    try:  # builders (pytest-xdist workers) take turns
        return build_once(venv, lambda building: _build(version, pins, borrowed, building),
                          wait_s=LOCK_WAIT_S) / "bin" / "python"
    except OSError as e:  # a TimeoutError too: another builder held the lock for more than LOCK_WAIT_S
        raise Unavailable(f"cannot build a venv for transformers=={version}: {e}") from None


def _build(version: str, pins: list[str], borrowed: str, building: Path) -> str:
    """Installs into ``building``; returns ``.complete``'s text (the version)."""
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(building)], check=True,
                       capture_output=True, timeout=300)
        # --no-deps: pip must not touch the borrowed environment; the pins are the missing dependencies.
        r = subprocess.run([sys.executable, "-m", "pip", "--python", str(building / "bin" / "python"), "install",
                            "-q", "--no-deps", f"transformers=={version}", *pins],
                           capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            raise Unavailable(f"pip could not install transformers=={version} {pins}: {r.stderr.strip()[-1500:]}")
        site = subprocess.run([str(building / "bin" / "python"), "-c",
                               "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        Path(site, "_borrowed_deps.pth").write_text(borrowed + "\n")
        check = subprocess.run([str(building / "bin" / "python"), "-c",
                                "import transformers, torch; print(transformers.__version__)"],
                               capture_output=True, text=True, timeout=300,
                               env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        if check.returncode != 0 or check.stdout.strip() != version:
            raise Unavailable(f"the venv for transformers=={version} does not import it: "
                              f"{(check.stdout + check.stderr).strip()[-1500:]}")
        return version + "\n"
    except (OSError, subprocess.SubprocessError) as e:
        raise Unavailable(f"cannot build a venv for transformers=={version}: {e}") from None
