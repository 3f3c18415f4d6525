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

How attention runs (``attention_backend``, chosen from the layers, the mask and the dtype):

- ``packed`` (Transformer Engine layers, ``document_causal``, bf16/fp16 — what a GPU run with TE gets):
  the batch's rows are laid end to end as one packed sequence in Megatron's THD layout, documents
  delimited by ``cu_seqlens``, which the loader makes on the host from ``doc_start``
  (:func:`documents_seq_params`; :func:`packed_seq_params` derives them on the device for a batch
  without them, at the cost of host syncs), and the spec's attention stays ``causal``: TE runs it as ``padding_causal`` with
  its flash/fused backends, each document attending only to itself, with no S x S mask. RoPE gets the
  plain frequency table and ``cu_seqlens``: TE's fused THD RoPE restarts positions at every packed
  sequence, which is where a document's positions restart (no per-token rows, no host sync). Under
  sequence parallelism the model lays a micro-batch's rows end to end as one row first
  (``FBTGPTModel.forward``), so each TP rank's sequence chunk is a contiguous 1/TP of the packed
  tokens, the layout Megatron's sequence-parallel THD path expects.
- ``flash`` (TE layers, ``causal``, bf16/fp16): TE's flash/fused causal attention.
- ``packed-unfused`` (TE layers >= 2.11, ``document_causal``, fp32): the packed layout on TE's unfused
  backend, which takes THD from TE 2.11 on (it pads each document to the micro-batch's longest, so its
  scores are 5·a·n·m² bytes per layer for n documents of at most m tokens).
- ``unfused`` (TE layers in fp32 before TE 2.11, or asked for the dense mask): TE's flash and fused
  backends run bf16/fp16 only and TE < 2.11 has no THD on its unfused backend, so fp32 runs the dense
  ``[B, 1, S, S]`` mask (``arbitrary``) on TE's unfused backend — 5·a·s²·b bytes of scores per layer
  (``fbt plan`` counts them).
- ``sdpa`` (Megatron's local layers: CPU, or a GPU without TE): Megatron's core attention is replaced by
  :class:`SDPADotProductAttention`, which computes the same thing with ``torch.nn.functional.
  scaled_dot_product_attention`` (fused kernels on CPU and GPU, no stored S x S probabilities) from a
  dense ``[B, 1, S, S]`` boolean mask (True = masked out, Megatron's convention). For
  ``document_causal`` the spec's self-attention is switched to ``AttnMaskType.arbitrary`` so the mask
  is honoured.

On CPU, :class:`SDPADotProductAttention` also runs the packed layout, one document at a time (each
document attended alone): the emulation of the GPU path that the tests compare with the mask path.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

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


def packed_rotary_length(max_sequence_length: int, packed_tokens: int) -> int:
    """Rows of the plain RoPE table handed to the packed (THD) path: at least the longest document,
    never the number of packed tokens. Megatron's unfused THD RoPE (the CPU emulation) reads a table of
    exactly ``cu_seqlens[-1]`` rows as one row per packed token at the token's offset (positions that
    do not restart); any other length maps each packed sequence from the table's row 0, as TE's fused
    THD RoPE does on GPU."""
    return max_sequence_length + (max_sequence_length == packed_tokens)


def packed_seq_params(reset: torch.Tensor) -> PackedSeqParams:
    """[S, B] document-start flags (row starts included) -> Megatron's ``PackedSeqParams`` for the B
    rows laid end to end (row b's tokens at b*S .. b*S+S-1): a document split across two rows is two
    sequences, each row starts one, tokens after a row's last start belong to that last document."""
    seq, batch = reset.shape
    starts = reset.t().reshape(-1).clone()
    starts[::seq] = True  # every row starts a sequence, whatever the flags say
    bounds = torch.cat([starts.nonzero().flatten(), torch.tensor([seq * batch], device=reset.device)])
    cu = bounds.to(torch.int32)
    longest = int((bounds[1:] - bounds[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def documents_seq_params(cu_seqlens: torch.Tensor, max_seqlen: int, device) -> PackedSeqParams:
    """Megatron's ``PackedSeqParams`` from the loader's ``cu_seqlens`` and ``max_seqlen``
    (``data_pipeline.documents.packed_documents``, made on the host): no device-to-host sync here."""
    cu = cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=int(max_seqlen),
                           max_seqlen_kv=int(max_seqlen))


def to_packed(x: torch.Tensor) -> torch.Tensor:
    """[S, B, D] -> [B*S, 1, D]: the rows end to end (Megatron's THD hidden layout, batch 1)."""
    seq, batch, hidden = x.shape
    return x.transpose(0, 1).reshape(seq * batch, 1, hidden)


def from_packed(x: torch.Tensor, batch: int) -> torch.Tensor:
    """[B*S, 1, D] -> [S, B, D], the inverse of :func:`to_packed`."""
    return x.reshape(batch, -1, x.shape[-1]).transpose(0, 1).contiguous()


def _uses_te_attention(spec) -> bool:
    core = spec.submodules.self_attention.submodules.core_attention
    return getattr(core, "__module__", "").startswith("megatron.core.extensions.transformer_engine")


HALF_DTYPES = (torch.bfloat16, torch.float16)
PACKED_BACKENDS = ("packed", "packed-unfused")  # what runs the THD layout on Transformer Engine
TE_UNFUSED_THD = (2, 11)  # TE 2.10 and earlier disable the unfused backend for qkv_format thd


def te_unfused_runs_thd(te_version: str | None) -> bool:
    """Whether Transformer Engine ``te_version`` (None: not installed) runs packed (THD) sequences on its
    unfused backend, the only one it has in fp32."""
    if te_version is None:
        return False
    from packaging.version import Version

    return Version(te_version).release[:2] >= TE_UNFUSED_THD


def installed_te_version() -> str | None:
    """The installed Transformer Engine's version, None without it."""
    from importlib import metadata

    try:
        return metadata.version("transformer_engine")
    except metadata.PackageNotFoundError:
        return None


def attention_backend(te_layers: bool, attention_mask: str, dtype: torch.dtype, te_version: str | None = None) -> str:
    """What runs attention (module doc): ``packed`` (TE, THD), ``flash`` (TE, causal), ``packed-unfused``
    (TE >= 2.11 in fp32, THD on its unfused backend), ``unfused`` (TE with a dense mask: fp32, where TE
    has neither flash nor fused attention, and before 2.11 no THD on its unfused one) or ``sdpa``
    (Megatron's local layers). ``te_version``: the TE the layers come from (None: assume one before 2.11).
    The two unfused ones store scores (``fbt plan`` counts the dense mask's 5·a·s²·b bytes per layer).
    Sequence parallelism changes nothing here: the packed path runs under it (``FBTGPTModel.forward``)."""
    if not te_layers:
        return "sdpa"
    if dtype not in HALF_DTYPES:
        thd = attention_mask == "document_causal" and te_unfused_runs_thd(te_version)
        return "packed-unfused" if thd else "unfused"
    return "flash" if attention_mask == "causal" else "packed"


def spec_backend(spec, attention_mask: str, dtype: torch.dtype) -> str:
    te_layers = _uses_te_attention(spec)
    return attention_backend(te_layers, attention_mask, dtype, installed_te_version() if te_layers else None)


class SDPADotProductAttention(DotProductAttention):
    """Megatron's local core attention computed by ``torch.nn.functional.scaled_dot_product_attention``
    (same inputs, outputs and dropout RNG): ``[sq, b, np, hn]`` query, ``[sk, b, ng, hn]`` key/value,
    a boolean mask (True = masked out) or none (then the spec's mask type: causal or none), output
    ``[sq, b, np*hn]``. With ``packed_seq_params`` (THD: ``[t, np, hn]``) each document is attended
    alone, causally: the reference for Transformer Engine's packed path. A fully masked query row
    (padding) gives 0 where Megatron's softmax gives the mean value: both are discarded."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None or self.config.softmax_type != "vanilla" or self.scale_mask_softmax.window_size:
            raise ValueError("SDPADotProductAttention supports neither attention bias, softmax offsets nor "
                             "sliding windows (use Megatron's DotProductAttention or Transformer Engine)")
        scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        dropout = self.attention_dropout.p if self.training else 0.0
        gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        if dropout > 0 and not self.config.sequence_parallel:  # as Megatron: the model-parallel RNG
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self._attend(query, key, value, attention_mask, attn_mask_type, packed_seq_params,
                                    scale, dropout, gqa)
        return self._attend(query, key, value, attention_mask, attn_mask_type, packed_seq_params, scale,
                            dropout, gqa)

    def _attend(self, query, key, value, mask, mask_type, packed, scale, dropout, gqa):
        def sdpa(q, k, v, **kw):  # [.., seq, heads, d] -> heads first and back
            out = F.scaled_dot_product_attention(q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2),
                                                 dropout_p=dropout, scale=scale, enable_gqa=gqa, **kw)
            return out.transpose(-3, -2)

        if packed is not None:
            if packed.qkv_format != "thd" or packed.cu_seqlens_q_padded is not None:
                raise ValueError("SDPADotProductAttention runs packed sequences in the thd format without padding")
            cu = packed.cu_seqlens_q.tolist()
            if cu != packed.cu_seqlens_kv.tolist():
                raise ValueError("packed self-attention needs cu_seqlens_q == cu_seqlens_kv")
            out = torch.cat([sdpa(query[a:b][None], key[a:b][None], value[a:b][None], is_causal=True)[0]
                             for a, b in zip(cu[:-1], cu[1:])])
            return out.reshape(out.shape[0], -1)
        sq, batch = query.shape[:2]
        sk = key.shape[0]
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))
        kw = {}
        if mask is not None:
            kw["attn_mask"] = ~mask
        elif (mask_type or self.attn_mask_type) == AttnMaskType.causal:
            if sq == sk:
                kw["is_causal"] = True
            else:  # queries are the last sq of the sk positions
                kw["attn_mask"] = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril(sk - sq)
        out = sdpa(q, k, v, **kw)  # [b, sq, np, hn]
        return out.transpose(0, 1).reshape(sq, batch, -1)


def adapt_layer_spec(spec, attention_mask: str, num_layers: int, packed: bool = False):
    """The layer spec with SDPA for Megatron's local core attention, attention honouring an arbitrary
    mask (``document_causal``, unless packed) and, in place of Megatron's torch norms (no apex/TE),
    ``norms.TorchNorm`` (marked for sequence parallelism).
    Returns a ModuleSpec, or TransformerBlockSubmodules when the block's final norm changes too; then
    ``num_layers`` is the number of layers this pipeline stage builds (Megatron's
    ``get_num_layers_to_build``), as Megatron's own block submodules would say. ``packed``: the model
    feeds packed sequences (THD), the attention stays causal within each."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from fbt_megatron.model.norms import TorchNorm, is_torch_norm

    spec = copy.deepcopy(spec)
    sub = spec.submodules
    if sub.self_attention.submodules.core_attention is DotProductAttention:
        sub.self_attention.submodules.core_attention = SDPADotProductAttention
    if attention_mask == "document_causal" and not packed:
        sub.self_attention.params = dict(sub.self_attention.params, attn_mask_type=AttnMaskType.arbitrary)
    if any(is_torch_norm(getattr(sub, n)) for n in ("input_layernorm", "pre_mlp_layernorm")):
        for name in ("input_layernorm", "pre_mlp_layernorm"):
            if is_torch_norm(getattr(sub, name)):
                setattr(sub, name, TorchNorm)
        # The block's final norm comes from the block submodules, not from the layer spec.
        return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=TorchNorm)
    return spec
