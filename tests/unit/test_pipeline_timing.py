"""Pipeline op timings use the clock that sees the work: CUDA events on CUDA (NCCL's work.wait() returns
before the transfer, kernels run after their launch), the host's perf_counter on CPU."""

import time

import torch

from fbt_megatron.parallel import timing


class FakeEvent:
    """A CUDA event on a fake device timeline: recorded at the next tick of ``clock`` (milliseconds)."""
    clock = [0.0]

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self):
        FakeEvent.clock[0] += 250.0  # each recorded event 0.25 s later on the device
        self.t = FakeEvent.clock[0]

    def elapsed_time(self, other):
        assert FakeEvent.synced, "elapsed_time before the events completed"
        return other.t - self.t


def test_cuda_clock_uses_events_and_waits_for_them(monkeypatch):
    synced = []
    FakeEvent.synced = False

    def synchronize():
        synced.append(True)
        FakeEvent.synced = True

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(timing.time, "perf_counter", lambda: 1000.0)  # the host clock stands still
    clock = timing.StepClock("cuda")
    a, b = clock.mark(), clock.mark()
    assert isinstance(a, FakeEvent)
    clock.resolve()
    assert synced == [True]
    assert clock.between(a, b) == 0.25
    assert clock.at(a) == 1000.25 and clock.at(b) == 1000.5  # device time from the step's origin


def test_cpu_clock_is_the_host_clock():
    clock = timing.StepClock("cpu")
    a = clock.mark()
    time.sleep(0.01)
    b = clock.mark()
    clock.resolve()
    assert isinstance(a, float) and clock.at(a) == a and 0.009 < clock.between(a, b) < 1.0
