"""Trainings that share a machine's cores (the feedback study runs two at once): the median step time of
each when every run takes its share of the cores (``FBT_CPU_THREADS`` = cores / jobs, what ``run_jobs``
sets) against every run taking all the cores (one ``fbt train`` alone on a node takes them all).

The runs of one setting start together; the settings alternate for ``--rounds`` rounds. A step's time is
read from the run's metrics (``seconds``), 1-pass steps only, after the first ``--warmup`` steps.

Usage: python benchmarks/bench_concurrent_runs.py [--jobs 2] [--steps 40] [--warmup 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/research/tiny_feedback.yaml"


def step_seconds(run_dir: Path, warmup: int) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["seconds"] for r in rows if r.get("passes") == 1 and r.get("step", 0) > warmup and "seconds" in r]


def run_together(jobs: int, threads: int, steps: int, warmup: int, tmp: Path) -> list[float]:
    """Median 1-pass step time of each of ``jobs`` trainings started at once with ``threads`` threads each."""
    from fbt_megatron.runtime import CPU_THREADS_ENV

    env = dict(os.environ, PYTHONPATH=str(ROOT), FBT_DEVICE="cpu", **{CPU_THREADS_ENV: str(threads)})
    procs, dirs = [], []
    for j in range(jobs):
        run_dir = Path(tempfile.mkdtemp(dir=tmp)) / "run"
        dirs.append(run_dir)
        cmd = [sys.executable, "-m", "fbt_megatron.cli", "train", RECIPE, f"run_dir={run_dir}", f"seed={j + 1}",
               f"train.steps={steps}", "schedule.feedback_start_step=1000000", "eval.at_end=false",
               "data.valid_sequences=8", "logging.tensorboard=false", "checkpoint.every=1000000"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))
    for p in procs:
        _, err = p.communicate()
        if p.returncode:
            raise SystemExit(f"a training failed (exit {p.returncode}):\n{err[-2000:]}")
    return [statistics.median(step_seconds(d, warmup)) for d in dirs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    from fbt_megatron.runtime import cpu_share, usable_cpus

    cores = usable_cpus()
    settings = {f"{cpu_share(a.jobs)} thread(s) each": cpu_share(a.jobs), f"{cores} threads each": cores}
    got: dict[str, list[float]] = {name: [] for name in settings}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(a.rounds):
            for name, threads in settings.items():
                got[name] += run_together(a.jobs, threads, a.steps, a.warmup, Path(tmp))
    print(f"{a.jobs} trainings at once on {cores} cores, {RECIPE}, 1-pass steps "
          f"{a.warmup + 1}-{a.steps}, {a.rounds} rounds")
    for name, values in got.items():
        print(f"  {name:>18}: median step {statistics.median(values):.3f} s  (per run: "
              + ", ".join(f"{v:.3f}" for v in values) + ")")
    one, many = (statistics.median(v) for v in got.values())
    print(f"  ratio (all the cores each / a share each): {many / one:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
