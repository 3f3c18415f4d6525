"""The torch norms of Megatron's local layers (no apex or Transformer Engine): usable under sequence
parallelism.

Megatron's ``WrappedTorchNorm`` returns ``torch.nn.LayerNorm``/``RMSNorm``. It refuses
``sequence_parallel`` because it cannot mark its weights for the gradient all-reduce that sequence
parallelism needs: under SP each TP rank normalises only its chunk of the sequence, so a norm's weight
gradient is partial and must be summed over the TP group. Megatron's apex/TE norms set
``param.sequence_parallel = True`` for that; :class:`TorchNorm` does the same for torch's norms, and
:class:`fbt_megatron.engine.Engine` sums such gradients over TP. The math of the norm is per token, so
nothing else changes.
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.torch_norm import WrappedTorchNorm


class TorchNorm:
    """Megatron's norm constructor for its local layers; returns a ``torch.nn.LayerNorm`` or
    ``torch.nn.RMSNorm`` in ``params_dtype`` (as apex's and TE's norms are; ``WrappedTorchNorm`` left them in
    the default dtype) whose weights carry ``sequence_parallel`` as the config says."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        # WrappedTorchNorm's refusals, except sequence parallelism (handled here): a torch norm has none
        # of these kernels, and ignoring zero-centred gamma would be the wrong formula
        for option in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
            if getattr(config, option, False):
                raise ValueError(f"{option} needs apex's or Transformer Engine's norm; the torch norm of "
                                 "Megatron's local layers has none")
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
