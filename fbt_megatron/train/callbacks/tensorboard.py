"""TensorBoard scalars (rank 0)."""

from __future__ import annotations

from pathlib import Path

from fbt_megatron.train.callbacks.base import Logger, is_rank0, step_metrics


class TensorBoardLogger(Logger):

    priority = 80
    def __init__(self, log_dir: Path, every: int = 1):
        self.log_dir, self.every, self.writer = Path(log_dir), every, None

    def on_train_start(self, trainer) -> None:
        if is_rank0():
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.log_dir))

    def on_step_end(self, trainer, r) -> None:
        self.log_metrics(trainer, step_metrics(trainer, r))

    def log_metrics(self, trainer, metrics: dict) -> None:
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, trainer.state.step)

    def on_train_end(self, trainer) -> None:
        self.close()

    def close(self) -> None:  # also when training failed before its end
        if self.writer is not None:
            self.writer.close()
            self.writer = None
