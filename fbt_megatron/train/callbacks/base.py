"""The callback protocol: hooks the trainer calls, in order of ``priority`` (higher first)."""

from __future__ import annotations

import logging

import torch.distributed as dist

from fbt_megatron.logs import printer

log_info = printer(logging.getLogger("fbt_megatron.train.callbacks"))


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class Callback:
    """A piece of a run the trainer calls at fixed points. ``priority``: callbacks run in decreasing
    priority at every hook (ties keep the order they were given in)."""

    priority: int = 0

    def on_train_start(self, trainer) -> None: ...
    def on_step_end(self, trainer, result) -> None: ...
    def log_metrics(self, trainer, metrics: dict) -> None: ...  # scalars logged outside a step (validation)
    def on_train_end(self, trainer) -> None: ...
    def close(self) -> None: ...  # release what the callback holds (after the run's last save)


class Logger(Callback):
    """A callback that records metrics: every logger receives the per-step scalars in ``on_step_end``
    and every other scalar (validation losses, ...) in :meth:`log_metrics`."""

    def log_metrics(self, trainer, metrics: dict) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement log_metrics")


def step_metrics(trainer, r) -> dict[str, float]:
    """The scalars of one step, under the names every logger uses (TensorBoard, W&B, metrics file)."""
    out: dict[str, float] = {}
    if not r.skipped:
        out["train/loss"] = r.loss
        out[f"train/loss_k{r.num_passes}"] = r.loss
        if r.grad_norm is not None:
            out["train/grad_norm"] = r.grad_norm
        for i, v in enumerate(r.residuals):
            out[f"feedback/residual_pass{i + 2}"] = v
    out["train/lr"] = r.lr
    out["train/num_passes"] = r.num_passes
    out["train/skipped_steps"] = trainer.state.skipped_steps
    if r.seconds > 0:
        out["perf/tokens_per_s"] = r.tokens / r.seconds
    return out
