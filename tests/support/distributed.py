"""Processes for the tests: ``run_distributed`` (N real gloo processes, each calling a function; shared with
the benchmarks in benchmarks/harness.py) and the children of a launcher."""

from __future__ import annotations

from benchmarks.harness import DistributedTestFailure, run_distributed

__all__ = ["DistributedTestFailure", "run_distributed", "child_pids"]


def child_pids(pid: int) -> list[int]:
    """The direct children of ``pid`` (e.g. torchrun's workers), sorted; [] once it is gone."""
    import psutil

    try:
        return sorted(c.pid for c in psutil.Process(pid).children())
    except psutil.NoSuchProcess:
        return []
