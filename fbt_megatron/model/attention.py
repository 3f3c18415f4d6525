"""What a token sees in a packed row: attention mask, positions and the layer spec that obeys them.

A training row packs several documents. ``ModelConfig.attention_mask`` chooses:

- ``document_causal`` (default): each document attends only to itself and its positions restart at
  0 at its first token, so a packed document is computed exactly as if it were alone in the row.
  That is what generation does (a document starts with no context), and it makes the Jacobi
  property hold per document: after k passes the first k positions *of every document* equal the
  token-by-token recurrence.
- ``causal``: every token attends to all earlier tokens of the row, previous documents included,
  with absolute positions 0..S-1 (Megatron's default pretraining layout). The recurrent state still
  restarts at each document; only attention crosses the boundary.

The mask is a dense ``[B, 1, S, S]`` boolean (True = masked out, Megatron's convention). Megatron's
fused/TE attention ignores a passed mask when the spec says ``causal``, so for ``document_causal``
the spec's self-attention is switched to ``AttnMaskType.arbitrary`` (the mask is then honoured by
the local softmax, its fused kernel and TE's unfused backend). A packed-sequence (THD, cu_seqlens)
path for flash attention on GPU is a later optimisation; this one is exact everywhere.
"""

from __future__ import annotations

import copy

import torch

ATTENTION_MASKS = ("document_causal", "causal")


def document_positions(reset: torch.Tensor) -> torch.Tensor:
    """[S, B] document-start flags (row start included) -> [B, S] positions restarting at 0."""
    seq = torch.arange(reset.shape[0], device=reset.device).unsqueeze(1).expand_as(reset)
    last_start = torch.where(reset, seq, torch.zeros_like(seq)).cummax(dim=0).values
    return (seq - last_start).t().contiguous()


def document_causal_mask(reset: torch.Tensor) -> torch.Tensor:
    """[S, B] document-start flags -> [B, 1, S, S] bool, True where query may NOT see key."""
    seq = reset.shape[0]
    doc = reset.long().cumsum(dim=0).t()  # [B, S] document index of each token
    later = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=reset.device), diagonal=1)
    other_doc = doc.unsqueeze(2) != doc.unsqueeze(1)  # [B, Sq, Sk]
    return (later.unsqueeze(0) | other_doc).unsqueeze(1)


def rotary_for_positions(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Megatron's RoPE table [S, 1, 1, D] and positions [B, S] -> per-token frequencies [S, B, 1, D]
    (Megatron's unfused RoPE broadcasts over the batch dimension)."""
    return table[:, 0, 0, :][positions.t()].unsqueeze(2)


def adapt_layer_spec(spec, attention_mask: str, sequence_parallel: bool, num_layers: int):
    """The layer spec with attention honouring an arbitrary mask (``document_causal``) and, under
    sequence parallelism with Megatron's torch norms (no apex/TE), norms marked for it. Returns a
    ModuleSpec, or TransformerBlockSubmodules when the block's final norm must change too."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from fbt_megatron.model.norms import SequenceParallelTorchNorm, is_torch_norm

    spec = copy.deepcopy(spec)
    sub = spec.submodules
    if attention_mask == "document_causal":
        sub.self_attention.params = dict(sub.self_attention.params, attn_mask_type=AttnMaskType.arbitrary)
    if sequence_parallel and any(is_torch_norm(getattr(sub, n)) for n in ("input_layernorm", "pre_mlp_layernorm")):
        for name in ("input_layernorm", "pre_mlp_layernorm"):
            if is_torch_norm(getattr(sub, name)):
                setattr(sub, name, SequenceParallelTorchNorm)
        # The block's final norm comes from the block submodules, not from the layer spec.
        return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=SequenceParallelTorchNorm)
    return spec
