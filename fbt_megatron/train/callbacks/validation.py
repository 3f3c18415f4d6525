"""Validation loss with 1 pass and with the feedback depth, every N steps and at the end."""

from __future__ import annotations

from fbt_megatron.train.callbacks.base import Callback


class Validation(Callback):
    """Validation loss every N steps with 1 pass and with the feedback depth, handed to every logger
    (``val/loss_kK``; the console prints them)."""

    priority = 100

    def __init__(self, every: int, evaluate_fn, passes: list[int], at_end: bool = True):
        self.every, self.evaluate_fn, self.passes = every, evaluate_fn, sorted(set(passes))
        self.at_end = at_end
        self._last_step = None

    def run(self, trainer) -> dict[int, float]:
        losses = {k: self.evaluate_fn(k) for k in self.passes}
        self._last_step = trainer.state.step
        trainer.metrics["val_loss"] = losses
        trainer.metrics.setdefault("val_history", []).append(
            {"step": trainer.state.step, "tokens": trainer.state.tokens_seen, "loss": losses})
        trainer.log_metrics({f"val/loss_k{k}": v for k, v in losses.items()})  # to every logger
        return losses

    def on_step_end(self, trainer, r) -> None:
        if trainer.state.step % self.every == 0:
            self.run(trainer)

    def on_train_end(self, trainer) -> None:
        # A preempted run saves and leaves at once (its job is about to be killed or requeued).
        if self.at_end and self._last_step != trainer.state.step and not trainer.metrics.get("preempted"):
            self.run(trainer)
