"""Document-causal attention without an S x S mask: the packed (THD) layout Transformer Engine runs on
GPU, derived from ``doc_start``, and the SDPA core attention that replaces Megatron's unfused one.

References are written from the definitions: ``cu_seqlens`` are the offsets of the documents of the
rows laid end to end; the packed path's emulation attends each document alone; Megatron's own
DotProductAttention is the reference for the SDPA module."""

import math

import pytest
import torch

from fbt_megatron.model.attention import (SDPADotProductAttention, document_causal_mask, document_positions,
                                          from_packed, packed_seq_params, to_packed)
from fbt_megatron.model.fbt_gpt import build_model, reset_positions
from tests.support.model_helpers import LLAMA, feedback, make_inputs, tiny_model_config


def test_cu_seqlens_and_positions_from_doc_start():
    seq = 6
    doc_start = torch.zeros(3, seq, dtype=torch.bool)
    doc_start[0, 2] = True  # row 0: documents [0, 2) and [2, 6) — the second runs on into row 1
    #                        row 1: no start: the rest of row 0's document, split at the row boundary
    doc_start[2, 0] = doc_start[2, 3] = True  # row 2: [0, 3), then [3, 6) (a last document, or filler)
    reset = reset_positions(doc_start, 3, seq, "cpu")
    params = packed_seq_params(reset)
    # rows end to end: row 0 at 0..5, row 1 at 6..11, row 2 at 12..17
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 2, 6, 12, 15, 18]
    assert params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_kv.tolist() == params.cu_seqlens_q.tolist()
    assert params.max_seqlen_q == params.max_seqlen_kv == 6
    assert document_positions(reset).tolist() == [[0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2]]
    # a doc_start whose rows do not flag their first token still starts a sequence at each row
    params = packed_seq_params(torch.zeros(4, 2, dtype=torch.bool))
    assert params.cu_seqlens_q.tolist() == [0, 4, 8]


def test_packed_layout_round_trip():
    x = torch.arange(2 * 3 * 4.0).reshape(3, 2, 4)  # [S=3, B=2, D=4]
    packed = to_packed(x)
    assert packed.shape == (6, 1, 4)
    assert torch.equal(packed[:3, 0], x[:, 0]) and torch.equal(packed[3:, 0], x[:, 1])  # row 0, then row 1
    assert torch.equal(from_packed(packed, 2), x)


def _core_attention(cls, config, mask_type):
    return cls(config, layer_number=1, attn_mask_type=mask_type, attention_type="self")


@pytest.mark.parametrize("groups", [4, 2])
def test_sdpa_equals_megatron_attention(single_process, groups):
    """SDPADotProductAttention == Megatron's DotProductAttention (values and input gradients), with a
    document mask, and causal without a mask; grouped-query attention with 2 KV heads."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from fbt_megatron.model.fbt_gpt import transformer_config

    config = transformer_config(tiny_model_config(num_query_groups=groups))
    s, b, heads, d = 10, 2, 4, 8
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s, b, heads, d, generator=g)
    k, v = (torch.randn(s, b, groups, d, generator=g) for _ in range(2))
    _, _, doc_start = make_inputs(seq=s)
    mask = document_causal_mask(reset_positions(doc_start, b, s, "cpu"))
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
    # (Megatron's own causal default mask is built on CUDA: the reference gets it explicitly.)
    for mask_type, ref_mask, m in ((AttnMaskType.arbitrary, mask, mask), (AttnMaskType.causal, causal, None)):
        outs, grads = [], []
        for cls, given in ((DotProductAttention, ref_mask), (SDPADotProductAttention, m)):
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            out = _core_attention(cls, config, mask_type)(*inputs, given)
            out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
            outs.append(out)
            grads.append([t.grad for t in inputs])
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-6)
        for a, r in zip(grads[1], grads[0]):
            torch.testing.assert_close(a, r, rtol=0, atol=1e-6)


def test_sdpa_packed_attends_each_document_alone(single_process):
    from megatron.core.transformer.enums import AttnMaskType

    from fbt_megatron.model.fbt_gpt import transformer_config

    config = transformer_config(tiny_model_config())
    t, heads, d = 9, 4, 8
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(t, heads, d, generator=g) for _ in range(3))
    reset = torch.zeros(9, 1, dtype=torch.bool)
    reset[0] = reset[4] = True  # documents [0, 4), [4, 9)
    out = _core_attention(SDPADotProductAttention, config, AttnMaskType.causal)(q, k, v, None,
                                                                                packed_seq_params=packed_seq_params(reset))
    for a, b in ((0, 4), (4, 9)):  # softmax(q k^T / sqrt(d)) v, causal, within the document only
        scores = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[a:b]).reshape(b - a, -1)
        torch.testing.assert_close(out[a:b], ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape,k,mode,seq", [("tiny", 1, "all", 10), ("llama", 3, "all", 10),
                                              ("llama", 2, "last", 10), ("llama", 2, "all", 16)])
def test_packed_emulation_equals_mask_path(single_process, shape, k, mode, seq):
    """The packed path (rows end to end, cu_seqlens, Megatron's THD RoPE from the plain table; each
    document attended alone on CPU) gives the mask path's loss, top states and every parameter's
    gradient to 1e-6 (gradients relative to their largest entry when that exceeds 1). At seq 16 the
    two rows pack 32 tokens, max_sequence_length: the table handed over is one row longer, so Megatron's
    THD RoPE still maps each document from position 0 (RoPE is relative, so an offset shared by a
    document attended alone would change values only by rounding: the length is pinned by
    test_packed_rope_inputs_are_the_plain_table)."""
    config = tiny_model_config(**(LLAMA if shape == "llama" else {}))
    ids, labels, doc_start = make_inputs(seq=seq)
    results = []
    for packed in (False, True):
        torch.manual_seed(0)
        model = build_model(config, feedback(grad_mode=mode), packed=packed).train()
        assert model.packed == packed
        out = model(ids, doc_start=doc_start, labels=labels, num_passes=k)
        out.token_loss.sum().backward()
        results.append((out.token_loss.detach(), out.hidden.detach(),
                        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss0, hidden0, grads0), (loss1, hidden1, grads1) = results
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=1e-6)
    torch.testing.assert_close(hidden1, hidden0, rtol=0, atol=1e-6)
    assert grads1.keys() == grads0.keys() and len(grads0) > 5
    for name in grads0:
        err = (grads1[name] - grads0[name]).abs().max() / grads0[name].abs().max().clamp_min(1.0)
        assert err <= 1e-6, (name, float(err))  # relative to the gradient's scale (fp32 rounding ~1e-7)


def test_attention_backend_per_dtype():
    """TE's flash and fused attention run bf16/fp16 only, and packed (THD) sequences have no unfused TE
    backend: fp32 on TE runs the dense mask on the unfused backend; sequence parallelism changes nothing."""
    from fbt_megatron.model.attention import attention_backend

    for dtype in (torch.bfloat16, torch.float16):
        assert attention_backend(True, "document_causal", dtype) == "packed"
        assert attention_backend(True, "causal", dtype) == "flash"
    for mask in ("document_causal", "causal"):
        assert attention_backend(True, mask, torch.float32) == "unfused"
        for dtype in (torch.float32, torch.bfloat16):
            assert attention_backend(False, mask, dtype) == "sdpa"


def test_packed_rope_inputs_are_the_plain_table(single_process):
    """The packed path hands RoPE the plain frequency table (no row per packed token, which sends
    Megatron's THD RoPE down its per-document .item() branch) and never a table as long as the packed
    tokens; on CPU (no TE) Megatron's unfused RoPE runs, on TE's packed path its fused THD RoPE."""
    from fbt_megatron.model.attention import packed_rotary_length

    assert packed_rotary_length(32, 20) == 32 and packed_rotary_length(32, 32) == 33
    model = build_model(tiny_model_config(**LLAMA), feedback(), packed=True)
    table = model.gpt.rotary_pos_emb(32)
    for batch, seq in ((2, 10), (2, 16), (1, 32)):
        _, positions = model.attention_inputs(reset_positions(None, batch, seq, "cpu"))
        freqs = model.rotary(positions)
        assert freqs.shape[1:] == table.shape[1:] and freqs.shape[0] != batch * seq
        torch.testing.assert_close(freqs[:32], table, rtol=0, atol=0)
    assert model.attention_backend == "packed-emulation" and not model.config.apply_rope_fusion


def test_packed_refused_with_a_causal_mask(single_process):
    with pytest.raises(ValueError, match="attention_mask: document_causal"):
        build_model(tiny_model_config(attention_mask="causal"), feedback(), packed=True)


@pytest.mark.gpu
def test_gpu_te_packed_equals_mask_path(cuda_device, single_process):
    """On CUDA with Transformer Engine: the TE spec's packed (THD, flash/fused, fused THD RoPE) attention
    gives the loss of its dense-mask (unfused) path on the same weights, in bf16."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError as e:
        pytest.skip(f"transformer-engine is not importable: {e}")
    config = tiny_model_config(**LLAMA)
    ids, labels, doc_start = (t.cuda() for t in make_inputs(seq=10))
    losses, first = [], None
    for packed in (False, True):
        model = build_model(config, feedback(), packed=packed, dtype=torch.bfloat16).train()
        # On a GPU the weights come from Megatron's RNG tracker, which torch.manual_seed does not reset:
        # the second model takes the first one's weights.
        if first is None:
            first = {k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}
        else:
            model.load_state_dict(first)
        core = model.gpt.decoder.layers[0].self_attention.core_attention
        assert type(core).__module__.startswith("megatron.core.extensions.transformer_engine"), type(core)
        assert model.attention_backend == ("packed" if packed else "unfused") and model.packed == packed
        assert model.config.apply_rope_fusion == packed
        out = model(ids, doc_start=doc_start, labels=labels, num_passes=2, jitter_seed=7)  # the same jitter noise
        losses.append(out.token_loss.float())
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-2, atol=2e-2)  # bf16


def test_padded_vocabulary_columns_are_minus_infinity_in_place(single_process):
    """The LM head's padded columns (vocab 64 padded to 128) are -inf, filled in place from a column index
    (no mask copied to the device per call): the other columns are the plain product, and no gradient
    reaches the padded rows of the output weight."""
    model = build_model(tiny_model_config(**LLAMA), feedback())
    assert model._padding_start == 64 and model._padding_columns[64:].all() and not model._padding_columns[:64].any()
    top = torch.randn(5, 2, 32, requires_grad=True)
    logits = model.head(top)  # [B, S, V_pad]
    weight = model.gpt.output_layer.weight
    assert logits.shape == (2, 5, 128) and torch.isneginf(logits[..., 64:]).all()
    torch.testing.assert_close(logits[..., :64], (top @ weight.t()).transpose(0, 1)[..., :64], rtol=0, atol=1e-6)
    labels = torch.randint(0, 64, (2, 5))
    model.head(top, labels).sum().backward()
    assert weight.grad[64:].abs().max() == 0 and weight.grad[:64].abs().max() > 0


def test_the_model_reports_the_attention_path_it_runs(single_process):
    """``FBTGPTModel.attention_backend`` (what docs/architecture.md's table and ``fbt plan`` name) on Megatron's
    local layers: ``sdpa`` with the dense mask, ``packed-emulation`` for packed sequences; neither fuses RoPE."""
    for packed, expected in ((False, "sdpa"), (True, "packed-emulation")):
        model = build_model(tiny_model_config(), feedback(), packed=packed)
        assert (model.attention_backend, model.packed) == (expected, packed)
        assert model.config.apply_rope_fusion is False
