"""Install fbt_megatron into an existing CUDA environment (an NGC PyTorch container, a cluster module)
without replacing its torch, Transformer Engine or apex.

    python tools/install_in_cuda_env.py [--dry-run] [--extras eval,wandb]

``pip install -e '.[gpu]'`` resolves the project's ``torch>=2.13,<2.14`` and would swap the container's
CUDA build of torch (and with it break the TE and apex built against it) for a wheel from PyPI. This
installs the package itself with ``--no-deps``, then its other requirements under a constraints file that
pins every one of the environment's NVIDIA-built packages (torch, transformer-engine, apex, flash-attn,
triton) to the version installed: pip then keeps them, or stops with a conflict instead of replacing them.
transformer-engine is added from PyPI only when the environment has none.
"""

from __future__ import annotations

import argparse
import os
import re
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
TE_REQUIREMENT = "transformer-engine[pytorch]>=2.0"
# The GPU check (make gpu-check) runs the GPU tests first: pytest and the timeout plugin pyproject.toml configures.
GPU_CHECK_REQUIREMENTS = ("pytest>=8", "pytest-timeout>=2.2")


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
    environment keeps, TE added when it has none, and pytest for the GPU check; constraints pinning each
    kept package to its version."""
    requirements = [r for r in dependencies if _name(r) not in KEPT]
    for extra in wanted_extras:
        if extra not in extras:
            raise ValueError(f"unknown extra {extra!r}; the project has {sorted(extras)}")
        requirements += [r for r in extras[extra] if _name(r) not in KEPT]
    if not any(name.startswith("transformer-engine") for name in installed):
        requirements.append(TE_REQUIREMENT)
    requirements += [r for r in GPU_CHECK_REQUIREMENTS if _name(r) not in {_name(x) for x in requirements}]
    constraints = [f"{name}=={version}" for name, version in sorted(installed.items())]
    return requirements, constraints


def commands(requirements: list[str], constraints_file: Path) -> list[list[str]]:
    pip = [sys.executable, "-m", "pip", "install"]
    return [pip + ["--no-deps", "-e", str(ROOT)], pip + ["-c", str(constraints_file), *requirements]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="print the constraints and pip commands only")
    ap.add_argument("--extras", default="", help="comma-separated optional extras (eval, wandb, research)")
    a = ap.parse_args(argv)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = installed_versions()
    if "torch" not in installed:
        print("install_in_cuda_env: this environment has no torch: install a CUDA build first (or use "
              "`pip install -e '.[gpu]'`, which installs torch from PyPI)", file=sys.stderr)
        return 2
    try:
        requirements, constraints = install_plan(project["dependencies"], installed,
                                                 project.get("optional-dependencies", {}),
                                                 [e for e in a.extras.split(",") if e])
    except ValueError as e:
        print(f"install_in_cuda_env: {e}", file=sys.stderr)
        return 2
    constraints_file = Path(tempfile.mkdtemp()) / "constraints.txt"
    constraints_file.write_text("\n".join(constraints) + "\n")
    print("kept at the installed version: " + ", ".join(constraints))
    for cmd in commands(requirements, constraints_file):
        print("$ " + " ".join(cmd))
        if not a.dry_run:
            subprocess.run(cmd, check=True, env={**os.environ, "DS_BUILD_OPS": "0"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
