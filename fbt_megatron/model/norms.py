"""Torch LayerNorm/RMSNorm usable under sequence parallelism (no apex or Transformer Engine).

Megatron's ``WrappedTorchNorm`` refuses ``sequence_parallel`` because it cannot mark its weights for
the gradient all-reduce that sequence parallelism needs: under SP each TP rank normalises only its
chunk of the sequence, so a norm's weight gradient is partial and must be summed over the TP group.
Megatron's apex/TE norms set ``param.sequence_parallel = True`` for that; this does the same for
torch's norms, and :class:`fbt_megatron.engine.Engine` sums such gradients over TP. The math
of the norm itself is per token, so nothing else changes.
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.torch_norm import WrappedTorchNorm


class SequenceParallelTorchNorm:
    """Same constructor as Megatron's norms; returns a ``torch.nn.LayerNorm`` or ``RMSNorm``."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"model.normalization={config.normalization!r}: allowed LayerNorm, RMSNorm")
        norm.to(dtype=config.params_dtype)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def is_torch_norm(module) -> bool:
    return module is WrappedTorchNorm
