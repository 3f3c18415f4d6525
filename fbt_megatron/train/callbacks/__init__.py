"""The pluggable pieces of a run, one module each. Every callback has an integer ``priority``: at each
hook the trainer calls them in decreasing priority (ties in the order given).

| priority | callback | module |
| --- | --- | --- |
| 100 | :class:`Validation` (losses to every logger) | :mod:`.validation` |
| 90 | :class:`ConsoleLogger` | :mod:`.console` |
| 80 | :class:`TensorBoardLogger` | :mod:`.tensorboard` |
| 70 | :class:`WandbLogger` | :mod:`.wandb_logger` |
| 60 | :class:`Preemption` (before the Checkpointer: a stop it sees is saved at once) | :mod:`.preemption` |
| 50 | :class:`MetricsFile` | :mod:`.metrics_file` |
| 40 | :class:`Checkpointer` | :mod:`.checkpointer` |
| 30 | :class:`Profiler` | :mod:`.profiler` |
| 0 | anything else (the default) | |

Hooks (:class:`~.base.Callback`): ``on_train_start``, ``on_step_end``, ``log_metrics`` (scalars outside a
step; every :class:`~.base.Logger` implements it), ``on_train_end``, ``close`` (after the run's last save).
"""

from fbt_megatron.train.callbacks.base import Callback, Logger, is_rank0, step_metrics
from fbt_megatron.train.callbacks.checkpointer import Checkpointer
from fbt_megatron.train.callbacks.console import (ConsoleLogger, attention_flops_per_pair, causal_pairs,
                                                  model_flops_per_token)
from fbt_megatron.train.callbacks.metrics_file import MetricsFile
from fbt_megatron.train.callbacks.preemption import Preemption
from fbt_megatron.train.callbacks.profiler import Profiler
from fbt_megatron.train.callbacks.tensorboard import TensorBoardLogger
from fbt_megatron.train.callbacks.validation import Validation
from fbt_megatron.train.callbacks.wandb_logger import WandbLogger

__all__ = ["Callback", "Checkpointer", "ConsoleLogger", "Logger", "MetricsFile", "Preemption", "Profiler",
           "TensorBoardLogger", "Validation", "WandbLogger", "attention_flops_per_pair", "causal_pairs", "is_rank0",
           "model_flops_per_token", "step_metrics"]
