"""Checkpoints every N steps, at the end, and when the run stops early (preemption, non-finite losses)."""

from __future__ import annotations

from fbt_megatron.train.callbacks.base import Callback, is_rank0, log_info


class Checkpointer(Callback):
    """Saves every N steps and at the end; ``poll_fn`` runs at every step end so that an async save is
    published as soon as its write has completed (not at the next save)."""

    priority = 40

    def __init__(self, save_fn, every: int, at_end: bool = True, print_fn=log_info, async_save: bool = False,
                 poll_fn=None):
        self.save_fn, self.every, self.at_end, self.print = save_fn, every, at_end, print_fn
        self.async_save, self.poll_fn = async_save, poll_fn
        self._last_step = None

    def save(self, trainer) -> None:
        path = self.save_fn(trainer.state)
        self._last_step = trainer.state.step
        trainer.metrics["checkpoint"] = str(path)
        if is_rank0():
            self.print(f"checkpoint {'scheduled' if getattr(self, 'async_save', False) else 'saved'}: {path}", flush=True)

    def on_step_end(self, trainer, r) -> None:
        if self.poll_fn is not None:
            self.poll_fn()
        if trainer.state.step % self.every == 0 or (trainer.stop_reason and self._last_step != trainer.state.step):
            self.save(trainer)

    def on_train_end(self, trainer) -> None:
        if (self.at_end or trainer.stop_reason) and self._last_step != trainer.state.step:
            self.save(trainer)
