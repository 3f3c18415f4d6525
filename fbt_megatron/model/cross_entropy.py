"""Megatron-Core's vocabulary-parallel cross entropy with the row maximum taken by ``torch.amax``.

Megatron's ``VocabParallelCrossEntropy.calculate_logits_max`` takes the maximum over the vocabulary with
``torch.max(logits, dim=-1)[0]``, which also computes (and throws away) the argmax: on CPU, logits of
[128, 8, 4096] in float32 with 2 threads, 2.3-2.6 ms against ``torch.amax``'s 0.13 ms — per micro-batch, as
much as the rest of the loss (at the 1.8M size of ``benchmarks/bench_train.py`` ~2.5 % of the step). The
values are the same (the maximum of the same numbers; NaN propagates in both), so the loss and its
gradient are bitwise Megatron's (``tests/test_cross_entropy.py``, pinned to the Megatron-Core versions it
was written against). Everything else in the loss is Megatron's own code.

:func:`install` puts :func:`calculate_logits_max` on Megatron's class (idempotent); the model calls it when
it is built.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

MEGATRON_LOGITS_MAX = VocabParallelCrossEntropy.calculate_logits_max


def calculate_logits_max(vocab_parallel_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``calculate_logits_max`` (same arguments and results), the maximum by ``torch.amax``."""
    vocab_parallel_logits = vocab_parallel_logits.float()
    return vocab_parallel_logits, torch.amax(vocab_parallel_logits, dim=-1)


def install() -> None:
    VocabParallelCrossEntropy.calculate_logits_max = staticmethod(calculate_logits_max)
