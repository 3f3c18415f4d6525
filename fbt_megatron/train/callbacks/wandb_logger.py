"""Weights & Biases (``logging.wandb: true``; rank 0)."""

from __future__ import annotations

from fbt_megatron.train.callbacks.base import Logger, is_rank0, step_metrics


class WandbLogger(Logger):
    """Optional (logging.wandb: true); needs the ``wandb`` package."""

    priority = 70

    def __init__(self, project: str, name: str, config: dict):
        self.project, self.name, self.config, self.run = project, name, config, None

    def on_train_start(self, trainer) -> None:
        if is_rank0():
            import wandb

            self.run = wandb.init(project=self.project, name=self.name, config=self.config)

    def on_step_end(self, trainer, r) -> None:
        self.log_metrics(trainer, step_metrics(trainer, r))

    def log_metrics(self, trainer, metrics: dict) -> None:
        if self.run is not None:
            self.run.log(dict(metrics), step=trainer.state.step)

    def on_train_end(self, trainer) -> None:
        self.close()

    def close(self) -> None:  # also when training failed before its end
        if self.run is not None:
            self.run.finish()
            self.run = None
