"""Preemption: SIGUSR1/SIGTERM or the preemption file stop the run after the step in flight."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from fbt_megatron.train.callbacks.base import Callback, is_rank0, log_info


class Preemption(Callback):
    """SIGUSR1 (SLURM's warning before the time limit, ``--signal=B:USR1@N``) or SIGTERM (scancel, node
    drain): finish the step in flight, then stop; the :class:`Checkpointer` after this callback saves
    because ``stop_reason`` is set. All ranks agree on the stop step (max-reduce of the flag every
    step), so a signal that reaches the ranks a few milliseconds apart stops them after the same step.

    Two ways in, so that the warning does not depend on how the cluster delivers signals:
    - ``stop_file``: the batch script's USR1 trap writes it (``$FBT_PREEMPT_FILE``); rank 0 looks for
      it at every step end. torchrun starts its workers in new sessions, so where the process tracker
      signals only the step's process group (``proctrack/pgid``) the signal never reaches them, and a
      worker that inherited an ignored USR1 (the batch script's torchrun ignores it) would drop one;
      the file is seen either way, also when it was written before training started.
    - the signals themselves, *blocked* in the training thread and polled with ``sigpending`` at each
      step end (a Python handler also catches one that lands on another thread). :meth:`arm` is called
      as early as the run starts (before the model is built), so a signal that arrives before the first
      step stays pending instead of killing the process or being lost. Why blocked: SLURM delivers a
      step signal to every process of the step, and helper processes forked by the trainer (megatron's
      checkpoint writers) inherit the mask; with a handler alone they would reset to the default action
      and die on USR1 in the middle of the save this signal asks for."""

    priority = 60

    SIGNALS = ("SIGUSR1", "SIGTERM")

    def __init__(self, device=None, signals=SIGNALS, print_fn=log_info, stop_file: str | Path | None = None):
        self.device, self.signals, self.print = device, [getattr(signal, s) for s in signals], print_fn
        self.stop_file = Path(stop_file) if stop_file else None
        self.received = 0
        self.source = ""
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        self.received = self.received or signum

    def arm(self) -> None:
        """Start catching the signals (idempotent; from the main thread only)."""
        if not self._previous and threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
            signal.pthread_sigmask(signal.SIG_BLOCK, self.signals)

    def on_train_start(self, trainer) -> None:
        self.arm()

    def _poll(self) -> int:
        if not self.received and self._previous:
            pending = signal.sigpending() & set(self.signals)
            if pending:
                self.received = min(pending)  # stays pending (blocked) until on_train_end
        if not self.received and self.stop_file is not None and is_rank0() and self.stop_file.exists():
            self.received, self.source = signal.SIGUSR1, f" (preemption file {self.stop_file})"
        return self.received

    def on_step_end(self, trainer, r) -> None:
        flag = self._poll()
        if dist.is_initialized():
            t = torch.tensor([flag], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = int(t.item())
        if flag and trainer.stop_reason is None:
            name = signal.Signals(flag).name
            trainer.metrics["preempted"] = name
            trainer.stop_reason = (f"preempted: {name} received{self.source}; stopped after step {trainer.state.step} "
                                   "with a checkpoint (a relaunch resumes from it)")
            if is_rank0():
                self.print(trainer.stop_reason, flush=True)

    def close(self) -> None:
        """Release the signals (idempotent). The trainer's ``close`` calls it after the run's last save
        has finished (not at train end: a SIGTERM during the final checkpoint must not kill the process
        halfway through it)."""
        if self._previous:
            # Unblock first: a pending signal then runs our handler (a no-op flag), not the old action.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)
            self._previous.clear()
