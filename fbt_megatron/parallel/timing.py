"""Timestamps of a pipeline step's ops, on the clock that sees the work: the host's on CPU, CUDA events
on CUDA. On NCCL ``work.wait()`` makes the current stream wait and returns at once, and kernels run
after their launch, so host timers there would measure launches, not compute or waiting."""

from __future__ import annotations

import time

import torch


class StepClock:
    """``mark()`` a point of the step; after :meth:`resolve`, :meth:`at` gives its time in seconds (host
    ``perf_counter`` scale) and :meth:`between` the seconds between two marks."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.origin_host = time.perf_counter()
        self.origin = self.mark() if self.cuda else None

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def resolve(self) -> None:
        """Wait until every marked event has happened (CUDA); nothing to wait for on the host."""
        if self.cuda:
            torch.cuda.synchronize()

    def at(self, mark) -> float:
        if not self.cuda:
            return mark
        return self.origin_host + self.origin.elapsed_time(mark) / 1000.0

    def between(self, start, end) -> float:
        return end - start if not self.cuda else start.elapsed_time(end) / 1000.0
