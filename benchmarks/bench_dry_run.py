"""``fbt train RECIPE --dry-run``: wall time of the whole command, next to the floor every ``fbt`` command
pays (``import fbt_megatron``, which imports torch).

Each is run ``--repeats`` times in a fresh process from an empty working directory (the recipe's relative
paths land there; the dry run writes nothing). Goal: the dry run under 5 s.

Usage: python benchmarks/bench_dry_run.py [--recipe recipes/tiny.yaml] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def wall(cmd: list[str], cwd: str) -> float:
    env = dict(os.environ, PYTHONPATH=str(ROOT), FBT_DEVICE=os.environ.get("FBT_DEVICE", "cpu"))
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "tiny.yaml"))
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as cwd:
        shutil.copy(a.recipe, Path(cwd) / "recipe.yaml")
        runs = {"import fbt_megatron": [sys.executable, "-c", "import fbt_megatron"],
                "fbt train --dry-run": [sys.executable, "-m", "fbt_megatron.cli", "train", "recipe.yaml", "--dry-run"]}
        times = {name: [] for name in runs}
        for _ in range(a.repeats):
            for name, cmd in runs.items():
                times[name].append(wall(cmd, cwd))
        assert sorted(p.name for p in Path(cwd).iterdir()) == ["recipe.yaml"], "the dry run wrote something"
    print(f"{'command':24s} {'median s':>9s} {'min s':>7s}")
    for name, t in times.items():
        print(f"{name:24s} {statistics.median(t):9.2f} {min(t):7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
