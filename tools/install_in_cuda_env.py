"""Install fbt_megatron into an existing CUDA environment (an NGC PyTorch container, a cluster module)
without replacing its torch, Transformer Engine or apex.

    python tools/install_in_cuda_env.py [--dry-run] [--extras eval,wandb]

``pip install -e '.[gpu]'`` may resolve another torch than the container's and would swap its
CUDA build (and with it break the TE and apex built against it) for a wheel from PyPI. This
installs the package itself with ``--no-deps``, then its other requirements under a constraints file that
pins every one of the environment's NVIDIA-built packages (torch, transformer-engine, apex, flash-attn,
triton) to the version installed: pip then keeps them, or stops with a conflict instead of replacing them.
transformer-engine is added from PyPI (the ``gpu`` extra's pins) only when the environment has none;
pytest and pytest-timeout (the ``test`` extra's pins) always come too, as ``make gpu-check``'s first step runs pytest.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Built against the environment's CUDA: kept at the installed version (distribution names as pip knows them).
KEPT = ("torch", "transformer-engine", "transformer-engine-torch", "transformer-engine-cu12", "apex",
        "flash-attn", "triton", "nvidia-cudnn-cu12", "nvidia-nccl-cu12")
# what the GPU check itself runs (pytest with its timeout plugin), taken from the ``test`` extra's pins
CHECK_TOOLS = ("pytest", "pytest-timeout")


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def installed_versions(names=KEPT) -> dict[str, str]:
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def install_plan(dependencies: list[str], installed: dict[str, str], extras: dict[str, list[str]],
                 wanted_extras=()) -> tuple[list[str], list[str]]:
    """(requirements, constraints): the project's requirements (and ``wanted_extras``') minus what the
    environment keeps, pytest for the GPU check, TE (the ``gpu`` extra) added when it has none;
    constraints pinning each kept package to its version."""
    requirements = [r for r in dependencies if _name(r) not in KEPT]
    for extra in wanted_extras:
        if extra not in extras:
            raise ValueError(f"unknown extra {extra!r}; the project has {sorted(extras)}")
        requirements += [r for r in extras[extra] if _name(r) not in KEPT]
    requirements += [r for r in extras.get("test", []) if _name(r) in CHECK_TOOLS and r not in requirements]
    if not any(name.startswith("transformer-engine") for name in installed):
        requirements += [r for r in extras.get("gpu", []) if _name(r).startswith("transformer-engine")]
    constraints = [f"{name}=={version}" for name, version in sorted(installed.items())]
    return requirements, constraints


def commands(requirements: list[str], constraints_file: Path) -> list[list[str]]:
    pip = [sys.executable, "-m", "pip", "install"]
    return [pip + ["--no-deps", "-e", str(ROOT)], pip + ["-c", str(constraints_file), *requirements]]


def main(argv=None) -> int:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="print the constraints and the pip commands (shell-quoted, to paste) only")
    ap.add_argument("--extras", default="", help=f"comma-separated optional extras ({', '.join(sorted(extras))})")
    a = ap.parse_args(argv)
    installed = installed_versions()
    if "torch" not in installed:
        print("install_in_cuda_env: this environment has no torch: install a CUDA build first (or use "
              "`pip install -e '.[gpu]'`, which installs torch from PyPI)", file=sys.stderr)
        return 2
    try:
        requirements, constraints = install_plan(project["dependencies"], installed, extras,
                                                 [e for e in a.extras.split(",") if e])
    except ValueError as e:
        print(f"install_in_cuda_env: {e}", file=sys.stderr)
        return 2
    print("kept at the installed version: " + ", ".join(constraints))
    if a.dry_run:  # the printed command reads the constraints file: it stays, and the output says where
        constraints_file = _write_constraints(Path(tempfile.mkdtemp(prefix="install_in_cuda_env.")), constraints)
        print(f"constraints file (kept for the second command; remove its folder when done): {constraints_file}")
        for cmd in commands(requirements, constraints_file):
            print("$ " + shlex.join(cmd))
        return 0
    with tempfile.TemporaryDirectory(prefix="install_in_cuda_env.") as tmp:  # removed once pip is done
        for cmd in commands(requirements, _write_constraints(Path(tmp), constraints)):
            print("$ " + shlex.join(cmd), flush=True)
            status = subprocess.run(cmd, env={**os.environ, "DS_BUILD_OPS": "0"}).returncode
            if status:
                print(f"install_in_cuda_env: pip exited with status {status} (its messages are above); the "
                      "commands after it did not run", file=sys.stderr)
                return status
    return 0


def _write_constraints(folder: Path, constraints: list[str]) -> Path:
    path = folder / "constraints.txt"
    path.write_text("\n".join(constraints) + "\n")
    return path


if __name__ == "__main__":
    sys.exit(main())
