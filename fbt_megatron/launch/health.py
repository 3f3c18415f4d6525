"""Per-node health check run by the batch script before training (one task per node).

Exits non-zero with a reason when the node cannot train: fewer GPUs than requested or one that
fails a small allocation + matmul, the run directory not writable, or under 5 GB free on it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
from pathlib import Path

from data_pipeline.argtypes import number


def check(run_dir: Path, gpus: int, min_free_gb: float = 5.0) -> list[str]:
    problems = []
    run_dir.mkdir(parents=True, exist_ok=True)
    probe = run_dir / f".health-{socket.gethostname()}-{os.getpid()}"
    try:
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        problems.append(f"run dir {run_dir} is not writable: {e}")
    free = shutil.disk_usage(run_dir).free / 1e9
    if free < min_free_gb:
        problems.append(f"only {free:.1f} GB free under {run_dir} (need {min_free_gb})")
    if gpus:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < gpus:
            problems.append(f"{n} GPUs visible, {gpus} requested")
        for i in range(min(n, gpus)):
            try:
                x = torch.randn(1024, 1024, device=f"cuda:{i}")
                float((x @ x).sum())
            except Exception as e:  # noqa: BLE001 - any failure makes the node unusable
                problems.append(f"GPU {i} failed a matmul: {e}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fbt_megatron.launch.health", description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--gpus", type=number(int, ge=0), default=0)
    ap.add_argument("--min-free-gb", type=number(float, ge=0), default=5.0)
    a = ap.parse_args(argv)
    problems = check(a.run_dir, a.gpus, a.min_free_gb)
    host = socket.gethostname()
    for p in problems:
        print(f"[health] {host}: {p}", file=sys.stderr)
    if not problems:
        print(f"[health] {host}: ok", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
