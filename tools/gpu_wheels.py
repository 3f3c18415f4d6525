"""Build the GPU check's wheelhouse for a CUDA image with Python 3.12 and its own torch (``make gpu-wheels``).

    python tools/gpu_wheels.py [--out build/gpu-wheels] [--requirements benchmarks/gpu_wheels.txt]
                               [--limit-mib 64] [--python-version 3.12]

Needs the package registry; the result installs offline (``benchmarks/gpu_check.py`` installs it with
``pip install --no-index --no-deps``). Into ``--out`` go: the pinned wheels of the requirements file for
cp312 manylinux x86_64 (or pure Python), DeepSpeed built from its source archive into a pure-Python
wheel (``DS_BUILD_OPS=0``: no compiled ops; the check uses torch's fused AdamW), and this project's
wheel. torch, Triton, Transformer Engine and NVIDIA libraries are never included: the image's are
kept. Prints a table of the wheels and their total size; exit status 1 when the total is over
``--limit-mib`` (default 64: what travels with the work tree), 2 on a bad requirements file.

Files it wrote before (listed in ``--out``/MANIFEST) are replaced; other files there are left alone,
counted in the size and named (``benchmarks/gpu_check.py`` installs only the wheels MANIFEST lists).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "benchmarks" / "gpu_wheels.txt"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
BUILT_FROM_SOURCE = ("deepspeed",)  # no wheel on the registry: `pip wheel` of the source archive
EXCLUDED = re.compile(r"^(torch|triton|nvidia-.*|transformer-engine.*)$")
MANIFEST = "MANIFEST"


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_requirements(path: Path) -> list[str]:
    """The pinned lines (``name==version``) of ``path``; raises ValueError naming a bad line."""
    lines = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", line)
        if not match:
            raise ValueError(f"{path}:{number}: {line!r} is not pinned as name==version")
        if EXCLUDED.match(normalise(match[1])):
            raise ValueError(f"{path}:{number}: {match[1]} comes with the CUDA image; leave it out")
        lines.append(line)
    return lines


def download_command(requirements: list[str], dest: Path, python_version: str) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
            "--python-version", python_version, "--implementation", "cp",
            "--abi", f"cp{python_version.replace('.', '')}", "--abi", "none", "--abi", "abi3",
            *[arg for p in PLATFORMS for arg in ("--platform", p)], "--dest", str(dest), *requirements]


def wheel_command(target: str, dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "--wheel-dir",
            str(dest), target]


def size_table(wheels: list[Path]) -> tuple[str, float]:
    rows = sorted(((w.stat().st_size / 2**20, w.name) for w in wheels), reverse=True)
    total = sum(mib for mib, _ in rows)
    lines = [f"{'MiB':>7}  wheel"] + [f"{mib:>7.2f}  {name}" for mib, name in rows] + [f"{total:>7.2f}  total"]
    return "\n".join(lines), total


def build(out: Path, requirements: list[str], python_version: str, run=subprocess.run) -> list[Path]:
    """Download and build into a fresh folder, then move the wheels into ``out`` (replacing the wheels of
    the previous build, named in its MANIFEST). Returns the wheels now in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-wheels-") as tmp:
        fresh = Path(tmp)
        binary = [r for r in requirements if normalise(r.split("==")[0]) not in BUILT_FROM_SOURCE]
        source = [r for r in requirements if normalise(r.split("==")[0]) in BUILT_FROM_SOURCE]
        run(download_command(binary, fresh, python_version), check=True)
        for requirement in source:
            run(wheel_command(requirement, fresh), check=True, env={**os.environ, "DS_BUILD_OPS": "0"})
        run(wheel_command(str(ROOT), fresh), check=True)
        built = sorted(fresh.glob("*.whl"))
        stray = [w.name for w in fresh.iterdir() if w.suffix != ".whl"]
        if stray:
            raise RuntimeError(f"pip left non-wheel files {stray}: a requirement has no wheel for this platform")
        manifest = out / MANIFEST
        previous = manifest.read_text().split() if manifest.exists() else []
        for name in previous:
            (out / name).unlink(missing_ok=True)
        for wheel in built:
            wheel.replace(out / wheel.name)
        manifest.write_text("".join(f"{w.name}\n" for w in built))
    return sorted(out.glob("*.whl"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "build" / "gpu-wheels"))
    ap.add_argument("--requirements", default=str(REQUIREMENTS))
    ap.add_argument("--limit-mib", type=float, default=64.0)
    ap.add_argument("--python-version", default="3.12")
    a = ap.parse_args(argv)
    try:
        requirements = read_requirements(Path(a.requirements))
    except (OSError, ValueError) as e:
        print(f"gpu_wheels: {e}", file=sys.stderr)
        return 2
    try:
        wheels = build(Path(a.out), requirements, a.python_version)
    except subprocess.CalledProcessError as e:
        print(f"gpu_wheels: {' '.join(map(str, e.cmd[:5]))} ... exited {e.returncode} (see pip's output above)",
              file=sys.stderr)
        return 1
    except RuntimeError as e:
        print(f"gpu_wheels: {e}", file=sys.stderr)
        return 1
    table, total = size_table(wheels)
    print(table)
    if total > a.limit_mib:
        print(f"gpu_wheels: {a.out} holds {total:.1f} MiB, over the {a.limit_mib:g} MiB that travel with the work "
              f"tree; take a package out of {a.requirements}", file=sys.stderr)
        return 1
    manifest = Path(a.out) / MANIFEST
    built = set(manifest.read_text().split()) if manifest.is_file() else {w.name for w in wheels}
    foreign = [w.name for w in wheels if w.name not in built]
    if foreign:
        print(f"gpu_wheels: {a.out} also holds {', '.join(foreign)}, which this build did not make: counted in the "
              "size, not installed by the GPU check")
    default = Path(a.out).resolve() == (ROOT / "build" / "gpu-wheels").resolve()
    then = ("make gpu-check GPU_PY=python3" if default
            else f"python3 benchmarks/gpu_check.py --wheels {a.out} --budget 480")
    print(f"gpu_wheels: {len(wheels)} wheels, {total:.1f} MiB of {a.limit_mib:g} in {a.out}; on the GPU machine, "
          f"from the work tree: {then} (docs/guides/first-gpu-run.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
