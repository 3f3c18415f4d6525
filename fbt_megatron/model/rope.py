"""RoPE on Megatron's unfused path with cos/sin computed once per forward, not twice per layer.

Megatron-Core's unfused ``apply_rotary_pos_emb`` (bshd layout) computes ``cos`` and ``sin`` of the
frequency table on every call — for q and for k, in every layer, every pass — and ends with a
``torch.cat`` of the rotated part and the pass-through part, a full copy of q and k even when the
pass-through part is empty. Hugging Face's Llama computes cos/sin once per forward. This module keeps
Megatron's formula, ``t·cos + rotate_half(t)·sin``, with the same roundings (so the results are bitwise
Megatron's), caches cos/sin per frequency tensor, writes the rotation half by half into one tensor
(:class:`_Rotate`: the ``sin`` product in two half-size pieces, no negated copy, concatenation or
full-size addition, forward or backward) and skips the final copy when the rotation covers the whole
head. In a training or full-sequence forward the model hands every layer and every pass the same
frequency tensor (and activation recompute hands it again), so cos/sin are computed once; decoding with
Megatron's KV cache slices the table per layer, so there every call computes its own (as Megatron's
function does). The cache's key and limits (identity and version; nothing kept under inference mode)
are ``model/tensor_memo.py``'s.

Every other case goes to Megatron's own function unchanged: fused RoPE (TE), the packed THD layout
(``cu_seqlens``, Transformer Engine's path on GPU), interleaved rotation, multi-latent attention, a YaRN
``mscale`` other than 1, partial rotary, frequencies that require grad.

:func:`install` puts :func:`apply_rotary_pos_emb` where Megatron's attention looks the function up
(``megatron.core.transformer.attention.apply_rotary_pos_emb``); the model calls it when it is built,
on the CPU path only (``fbt_gpt.install_cpu_replacements``): a GPU runs Megatron's and TE's own RoPE.
``tests/test_rope.py`` pins it to the Megatron-Core versions it was written against.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer import attention as megatron_attention

from fbt_megatron.model.tensor_memo import LastTensorMemo

MEGATRON_APPLY = rope_utils.apply_rotary_pos_emb  # Megatron's dispatcher: every case this module does not take


def _cos_sin(freqs: torch.Tensor, dtype: torch.dtype):
    return torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)


_CACHE = LastTensorMemo(_cos_sin)  # cos and sin per frequency tensor and dtype


class _Rotate(torch.autograd.Function):
    """``t·cos + rotate_half(t)·sin`` with ``rotate_half(t) = [-t_2, t_1]``, written half by half into
    one tensor: ``out_1 = t_1 c_1 - t_2 s_1``, ``out_2 = t_2 c_2 + t_1 s_2``. Megatron's expression
    makes the negated half, the concatenation and two full products, then adds them (and its backward
    undoes the concatenation the same way); here each half's ``sin`` product is subtracted or added in
    place. ``(-a)·b + c`` and ``c - a·b`` round alike, so values and gradients are bitwise Megatron's
    (``tests/test_rope.py``)."""

    @staticmethod
    def forward(ctx, t, cos, sin):
        half = t.shape[-1] // 2
        out = torch.mul(t, cos)
        out[..., :half].sub_(torch.mul(t[..., half:], sin[..., :half]))
        out[..., half:].add_(torch.mul(t[..., :half], sin[..., half:]))
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        # d/dt_1 = g_1 c_1 + g_2 s_2, d/dt_2 = g_2 c_2 - g_1 s_1: the transpose of the rotation
        cos, sin = ctx.saved_tensors
        half = grad.shape[-1] // 2
        grad_t = torch.mul(grad, cos)
        grad_t[..., :half].add_(torch.mul(grad[..., half:], sin[..., half:]))
        grad_t[..., half:].sub_(torch.mul(grad[..., :half], sin[..., :half]))
        return grad_t, None, None


def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale: float = 1.0, cp_group=None):
    """Megatron's ``apply_rotary_pos_emb`` (same arguments and results), cos/sin cached (module doc)."""
    if (config.apply_rope_fusion or cu_seqlens is not None or config.rotary_interleaved
            or config.multi_latent_attention or mscale != 1.0 or freqs.requires_grad
            or freqs.shape[-1] != t.shape[-1]):
        return MEGATRON_APPLY(t, freqs, config=config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
    cos, sin = _CACHE.get(freqs, t.dtype)
    return _Rotate.apply(t, cos, sin)


def install() -> None:
    """Make Megatron's attention layers use :func:`apply_rotary_pos_emb` (idempotent)."""
    megatron_attention.apply_rotary_pos_emb = apply_rotary_pos_emb
