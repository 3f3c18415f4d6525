"""A short, model-agnostic training loop.

The trainer knows steps, batches, a learning-rate function and callbacks; what a step *does* (FBT's
pass count, multi-pass forward, loss by pass count) lives in the step function it is given
(:mod:`train_step`), and checkpointing, logging, validation and profiling are callbacks
(:mod:`callbacks`). State that must survive a restart is in :class:`TrainState`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

from fbt_megatron.logs import printer
from fbt_megatron.train.callbacks.base import Callback


@dataclass
class TrainState:
    step: int = 0  # optimiser steps taken (including skipped ones); the next step's index
    consumed_sequences: int = 0  # global data cursor, independent of the DP size
    optimizer_steps: int = 0  # steps actually applied
    skipped_steps: int = 0
    nonfinite_in_row: int = 0
    pass_counts: dict[str, int] = field(default_factory=dict)  # "k" -> steps with k passes
    tokens_seen: int = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, data: dict) -> None:
        names = {f for f in self.__dataclass_fields__}
        for key, value in data.items():
            if key in names:
                setattr(self, key, value)


class NonFiniteLossError(RuntimeError):
    pass


class Trainer:
    def __init__(self, *, step_fn: Callable, batches: Iterator, micro_batches_per_step: int,
                 lr_fn: Callable[[int], float], total_steps: int, global_batch_size: int,
                 state: TrainState | None = None, callbacks: list[Callback] = (),
                 max_nonfinite_in_row: int = 5, log=printer(logging.getLogger(__name__))):
        self.step_fn, self.batches, self.mbs_per_step = step_fn, batches, micro_batches_per_step
        self.lr_fn, self.total_steps, self.global_batch_size = lr_fn, total_steps, global_batch_size
        self.state = state or TrainState()
        self.callbacks = sorted(callbacks, key=lambda cb: -cb.priority)  # stable: ties keep their order
        self.max_nonfinite_in_row = max_nonfinite_in_row
        self.log = log
        self.history: list = []  # StepResults of this process's run
        self.stop_reason: str | None = None
        self.metrics: dict = {}  # filled by callbacks (validation losses, ...)

    def _emit(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    def log_metrics(self, metrics: dict) -> None:
        """Hand scalars (e.g. validation losses) to every callback's ``log_metrics``, at this step."""
        self._emit("log_metrics", metrics)

    def close(self) -> None:
        """Every callback's ``close`` (the run calls it after its last save has finished)."""
        for cb in self.callbacks:
            cb.close()

    def fit(self) -> TrainState:
        self._emit("on_train_start")
        s = self.state
        while s.step < self.total_steps and self.stop_reason is None:
            batch = [next(self.batches) for _ in range(self.mbs_per_step)]
            t0 = time.perf_counter()
            result = self.step_fn(s.step, batch, self.lr_fn(s.step))
            result.seconds = time.perf_counter() - t0
            s.step += 1
            s.consumed_sequences += self.global_batch_size
            s.tokens_seen += result.tokens
            k = str(result.num_passes)
            s.pass_counts[k] = s.pass_counts.get(k, 0) + 1
            if result.skipped:
                s.skipped_steps += 1
                s.nonfinite_in_row += 1
                self.log(f"step {result.step}: non-finite loss ({result.loss}) or gradient (norm "
                         f"{result.grad_norm}); step skipped "
                         f"({s.nonfinite_in_row} in a row, {s.skipped_steps} in total)")
                if s.nonfinite_in_row >= self.max_nonfinite_in_row:
                    self.stop_reason = (
                        f"stopped: {s.nonfinite_in_row} non-finite losses in a row at step {result.step} "
                        f"(train.max_nonfinite_in_row={self.max_nonfinite_in_row}); the checkpoint holds the "
                        "last finite weights")
            else:
                s.nonfinite_in_row = 0
                s.optimizer_steps += 1
            self.history.append(result)
            self._emit("on_step_end", result)
        self._emit("on_train_end")
        return s
