"""Callbacks run in decreasing ``priority`` at every hook, whatever their place in the list (ties keep the
order given); the trainer's ``close`` reaches every callback; the shipped callbacks' priorities are the
table in ``train/callbacks/__init__.py``; every logger of the package implements ``log_metrics``."""

from __future__ import annotations

import pytest

from fbt_megatron.train import callbacks as cb
from fbt_megatron.train.train_step import StepResult
from fbt_megatron.train.trainer import Trainer


class Recorder(cb.Callback):
    def __init__(self, name: str, priority: int, calls: list):
        self.name, self.priority, self.calls = name, priority, calls

    def on_train_start(self, trainer):
        self.calls.append(("on_train_start", self.name))

    def on_step_end(self, trainer, result):
        self.calls.append(("on_step_end", self.name))

    def log_metrics(self, trainer, metrics):
        self.calls.append(("log_metrics", self.name))

    def on_train_end(self, trainer):
        self.calls.append(("on_train_end", self.name))

    def close(self):
        self.calls.append(("close", self.name))


def test_hooks_run_in_priority_order_ties_in_given_order():
    calls: list = []
    given = [Recorder("low", -5, calls), Recorder("tie_a", 10, calls), Recorder("high", 100, calls),
             Recorder("tie_b", 10, calls), Recorder("default", 0, calls)]
    trainer = Trainer(step_fn=lambda step, batch, lr: StepResult(step=step, num_passes=1, loss=1.0, tokens=1,
                                                                  skipped=False, grad_norm=1.0, lr=lr),
                      batches=iter(range(10)), micro_batches_per_step=1, lr_fn=lambda s: 1e-3, total_steps=1,
                      global_batch_size=1, callbacks=given, log=lambda *a: None)
    trainer.fit()
    trainer.log_metrics({"val/loss_k1": 1.0})
    trainer.close()
    order = ["high", "tie_a", "tie_b", "default", "low"]
    hooks = ["on_train_start", "on_step_end", "on_train_end", "log_metrics", "close"]
    assert calls == [(hook, name) for hook in hooks for name in order]


def test_shipped_priorities_are_the_documented_order():
    documented = [cb.Validation, cb.ConsoleLogger, cb.TensorBoardLogger, cb.WandbLogger, cb.Preemption,
                  cb.MetricsFile, cb.Checkpointer, cb.Profiler]
    priorities = [c.priority for c in documented]
    assert priorities == sorted(priorities, reverse=True) and len(set(priorities)) == len(priorities)
    assert cb.Preemption.priority > cb.Checkpointer.priority  # a stop it sees is saved in the same step


def test_every_logger_implements_log_metrics():
    loggers = [getattr(cb, name) for name in cb.__all__
               if isinstance(getattr(cb, name), type) and issubclass(getattr(cb, name), cb.Logger)
               and getattr(cb, name) is not cb.Logger]
    assert {c.__name__ for c in loggers} == {"ConsoleLogger", "MetricsFile", "TensorBoardLogger", "WandbLogger"}
    for c in loggers:
        assert c.log_metrics is not cb.Logger.log_metrics, f"{c.__name__} does not implement log_metrics"

    class Silent(cb.Logger):
        pass

    with pytest.raises(NotImplementedError, match="Silent must implement log_metrics"):
        Silent().log_metrics(None, {})
