"""Full (TP=1, logical-vocabulary) tensors <-> this rank's tensor-parallel slice of a parameter.

Two layouts are not a plain chunk of the full tensor:
- the SwiGLU ``linear_fc1`` ([gate; up] rows at TP=1): each TP rank holds [its gate rows; its up rows];
- vocabulary-parallel weights: the full tensor has ``vocab_size`` rows, a rank holds a slice of the
  padded vocabulary (``vocab.py``), padding rows beyond the logical vocabulary.
Used by the TP-equivalence tests and by anything that moves weights between layouts (exports).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state


def _tp():
    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


def is_glu_fc1(name: str, model) -> bool:
    return bool(getattr(getattr(model, "config", None), "gated_linear_unit", False)) and ".mlp.linear_fc1." in name


def is_vocab_parallel(name: str) -> bool:
    return name.endswith(("embedding.word_embeddings.weight", "output_layer.weight"))


def to_local(name: str, full: torch.Tensor, param, model) -> torch.Tensor:
    """This rank's slice of ``full`` (a TP=1 tensor of parameter ``name``) in ``param``'s layout."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    tp, rank = _tp()
    dim = param.partition_dim
    if is_glu_fc1(name, model):
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp, dim)[rank], up.chunk(tp, dim)[rank]], dim).contiguous()
    if is_vocab_parallel(name):
        padded = torch.zeros((param.shape[0] * tp, *full.shape[1:]), dtype=full.dtype)
        padded[: full.shape[0]] = full
        full = padded
    return full.chunk(tp, dim=dim)[rank].contiguous()


def to_full(name: str, local: torch.Tensor, param, model) -> torch.Tensor:
    """The TP=1 tensor from every rank's ``local`` slice of parameter ``name`` (a TP collective)."""
    if not getattr(param, "tensor_model_parallel", False):
        return local
    tp, _ = _tp()
    dim = param.partition_dim
    parts = [torch.empty_like(local) for _ in range(tp)]
    torch.distributed.all_gather(parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    if is_glu_fc1(name, model):
        halves = [p.chunk(2, dim) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim)
    full = torch.cat(parts, dim=dim)
    if is_vocab_parallel(name) and hasattr(model, "model_config"):
        full = full[: model.model_config.vocab_size]
    return full
