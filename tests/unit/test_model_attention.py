"""Document-causal attention: a packed document is computed as if it were alone (as in generation),
and multi-pass teacher forcing is exact on the first k positions of *every* document."""

import dataclasses

import pytest
import torch

from fbt_megatron.model.attention import document_positions
from fbt_megatron.model.fbt_gpt import build_model, reset_positions
from fbt_megatron.model.kernels import fused_switches
from fbt_megatron.model.sequential import sequential_forward
from tests.support.model_helpers import feedback, make_inputs, tiny_model_config

SEQ = 10


def model_with(attention_mask):
    torch.manual_seed(0)
    return build_model(tiny_model_config(attention_mask=attention_mask), feedback()).eval()


@pytest.mark.parametrize("k", [1, 3])
def test_packed_document_equals_document_alone(single_process, k):
    ids = make_inputs(seq=SEQ)[0][:1]
    doc_start = torch.zeros(1, SEQ, dtype=torch.bool)
    doc_start[0, 4] = True  # documents [0, 4) and [4, 10)
    outputs = {}
    for mode in ("document_causal", "causal"):
        model = model_with(mode)
        with torch.no_grad():
            packed = model(ids, doc_start=doc_start, num_passes=k)
            alone = model(ids[:, 4:], num_passes=k)  # the second document, alone in its row
        outputs[mode] = (packed.hidden[4:], alone.hidden)  # top states [S, B, D] (unit scale)
    packed, alone = outputs["document_causal"]
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)  # measured ~1e-6
    packed, alone = outputs["causal"]  # attention across documents: the second one sees the first
    assert (packed - alone).abs().max() > 2e-4


def test_jacobi_exact_on_first_k_positions_of_every_document(single_process):
    model = model_with("document_causal")
    ids, _, doc_start = make_inputs(seq=SEQ)  # row 0: documents at 0, 4; row 1: at 0, 3, 7
    ref = sequential_forward(model, ids, doc_start=doc_start)
    in_doc = document_positions(reset_positions(doc_start, 2, SEQ, ids.device))  # [B, S]
    for k in (1, 2, 3):
        with torch.no_grad():
            out = model(ids, doc_start=doc_start, num_passes=k)
        err = (out.logits - ref.logits).norm(dim=-1) / ref.logits.norm(dim=-1)  # [B, S]
        assert err[in_doc < k].max() <= 1e-5, (k, err)
        assert err[in_doc >= k].min() > 1e-4, (k, err)  # not yet converged further into each document
    with torch.no_grad():
        out = model(ids, doc_start=doc_start, num_passes=int(in_doc.max()) + 1)  # longest document
    assert ((out.logits - ref.logits).norm(dim=-1) / ref.logits.norm(dim=-1)).max() <= 1e-5


def test_fused_switches_only_with_their_kernels(single_process):
    """A GPU without apex/TE must not ask Megatron's torch norm for a persistent fused layer norm."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    none = fused_switches("LayerNorm", on_gpu=True, available=lambda name: False)
    assert not none["persist_layer_norm"] and not none["masked_softmax_fusion"]
    assert none["bias_dropout_fusion"]  # torch jit: any GPU
    # activation fusion only for SwiGLU: Megatron's fused GELU is the tanh approximation
    assert not none["bias_activation_fusion"]
    assert fused_switches("LayerNorm", on_gpu=True, available=lambda name: False, activation="swiglu")["bias_activation_fusion"]
    every = fused_switches("LayerNorm", on_gpu=True, available=lambda name: True)
    assert every["persist_layer_norm"] and every["masked_softmax_fusion"]
    assert not fused_switches("RMSNorm", on_gpu=True, available=lambda name: True)["persist_layer_norm"]
    assert not any(fused_switches("LayerNorm", on_gpu=False, available=lambda name: True).values())
    # no compiler on CPU: Megatron's unfused SwiGLU there
    assert not any(fused_switches("RMSNorm", on_gpu=False, available=lambda name: True, activation="swiglu").values())

    config = build_model(tiny_model_config(), feedback()).config
    WrappedTorchNorm(dataclasses.replace(config, **none), 32)  # the local spec's norm accepts it
    with pytest.raises(AssertionError, match="persist_layer_norm"):  # what the old switches asked for
        WrappedTorchNorm(dataclasses.replace(config, persist_layer_norm=True), 32)
