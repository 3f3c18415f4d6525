"""Megatron-Core's vocabulary-parallel cross entropy with the row maximum taken by ``torch.amax``.

Megatron's ``VocabParallelCrossEntropy.calculate_logits_max`` takes the maximum over the vocabulary with
``torch.max(logits, dim=-1)[0]``, which also computes (and throws away) the argmax: on CPU, logits of
[128, 8, 4096] in float32 with 2 threads, 2.3-2.6 ms against ``torch.amax``'s 0.13 ms — per micro-batch, as
much as the rest of the loss (at the 1.8M size of ``benchmarks/bench_train.py`` ~2.5 % of the step). The
values are the same (the maximum of the same numbers; NaN propagates in both), so the loss and its
gradient are bitwise Megatron's (``tests/test_cross_entropy.py``, pinned to the Megatron-Core versions it
was written against). Everything else in the loss is Megatron's own code.

Over a one-rank tensor-parallel group on CPU, :func:`vocab_parallel_cross_entropy` runs Megatron's steps
(its own static methods, in its order) without the three all-reduces of the logits' maximum, the target's
logit and the exponentials' sum, each the identity over one rank but a gloo call that hands the tensor to
its worker thread and waits (~60 µs each on this project's CPU machine; six a step at the 1.8M size of
``benchmarks/bench_train.py``). Label smoothing, GPU tensors and TP > 1 keep Megatron's function.

:func:`install` puts :func:`calculate_logits_max` on Megatron's class and :func:`vocab_parallel_cross_entropy`
where Megatron's language models look it up (``megatron.core.tensor_parallel``), idempotent; the model calls
it when it is built, on the CPU path only (``fbt_gpt.install_cpu_replacements``): a GPU runs Megatron's loss.
"""

from __future__ import annotations

import megatron.core.tensor_parallel
import torch
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

from fbt_megatron.model.one_rank_linear import one_rank

MEGATRON_LOGITS_MAX = VocabParallelCrossEntropy.calculate_logits_max
MEGATRON_CROSS_ENTROPY = megatron.core.tensor_parallel.vocab_parallel_cross_entropy


def calculate_logits_max(vocab_parallel_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``calculate_logits_max`` (same arguments and results), the maximum by ``torch.amax``."""
    vocab_parallel_logits = vocab_parallel_logits.float()
    return vocab_parallel_logits, torch.amax(vocab_parallel_logits, dim=-1)


class _OneRankCrossEntropy(torch.autograd.Function):
    """Megatron's ``_VocabParallelCrossEntropy`` without label smoothing over one rank: its steps, minus the
    all-reduces (the whole vocabulary is this rank's, from 0)."""

    @staticmethod
    def forward(ctx, logits, target):
        steps = VocabParallelCrossEntropy
        logits, logits_max = steps.calculate_logits_max(logits)
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = steps.calculate_predicted_logits(
            logits, target, logits_max, 0, logits.size(-1))
        softmax, loss = steps.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        steps = VocabParallelCrossEntropy
        grad_2d, arange_1d, update, grad_input = steps.prepare_gradient_calculation_operands(softmax, target_mask)
        return steps.calculate_gradients(grad_2d, arange_1d, masked_target_1d, update, grad_input, grad_output), None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0):
    """Megatron's function (same arguments and results); over one CPU rank without its all-reduces."""
    if label_smoothing == 0.0 and vocab_parallel_logits.device.type == "cpu" and one_rank(None):
        return _OneRankCrossEntropy.apply(vocab_parallel_logits, target)
    return MEGATRON_CROSS_ENTROPY(vocab_parallel_logits, target, label_smoothing)


def install() -> None:
    VocabParallelCrossEntropy.calculate_logits_max = staticmethod(calculate_logits_max)
    megatron.core.tensor_parallel.vocab_parallel_cross_entropy = vocab_parallel_cross_entropy
