"""Llama-class options build the intended Megatron block, fail clearly when invalid, and the k-pass
forward computes the token gate once; activation recompute changes memory, not gradients."""

import pytest
import torch
from pydantic import ValidationError

from fbt_megatron.config import ModelConfig
from fbt_megatron.model.fbt_gpt import build_model
from tests.support.model_helpers import LLAMA, feedback, make_inputs, tiny_model_config


def test_llama_block_structure(single_process):
    cfg = tiny_model_config(**LLAMA)
    model = build_model(cfg, feedback())
    params = dict(model.named_parameters())
    assert not [n for n in params if n.endswith(".bias") and n.startswith("gpt.")]  # bias-free linears
    assert params["gpt.decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 48, 32)  # SwiGLU [gate; up]
    head_dim = 32 // 4
    assert params["gpt.decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * head_dim, 32)  # GQA
    assert isinstance(model.gpt.decoder.final_layernorm, torch.nn.RMSNorm)
    assert "gpt.output_layer.weight" in params  # untied
    assert params["gpt.embedding.word_embeddings.weight"].shape[0] == 128  # 64 padded to 128
    inv_freq = model.gpt.rotary_pos_emb.inv_freq
    torch.testing.assert_close(inv_freq[1], torch.tensor(500000.0) ** (-2 / head_dim))


def test_invalid_llama_options_name_the_key():
    with pytest.raises(ValidationError, match=r"model.num_query_groups=3 must divide model.num_attention_heads=4; allowed: \[1, 2, 4\]"):
        ModelConfig(num_attention_heads=4, num_query_groups=3)
    with pytest.raises(ValueError, match=r"model.num_query_groups=1 is not divisible by tensor parallel size 2"):
        ModelConfig(num_attention_heads=4, num_query_groups=1).check_tensor_parallel(2)
    with pytest.raises(ValidationError, match=r"activation"):
        ModelConfig(activation="relu")
    assert ModelConfig(vocab_size=32000).padded_vocab_size(4) == 32256  # the tokenizer's size stays 32000


def test_token_gate_computed_once_per_forward(single_process):
    torch.manual_seed(0)
    model = build_model(tiny_model_config(), feedback(jitter_std=0.0))
    calls = []
    model.feedback.gate.register_forward_hook(lambda *a: calls.append(1))
    ids, labels, doc_start = make_inputs()
    model(ids, doc_start=doc_start, labels=labels, num_passes=3).token_loss.sum().backward()
    assert len(calls) == 1  # W_G e and its sigmoid do not change between passes


@pytest.mark.parametrize("grad_mode", ["all", "last"])
def test_recompute_gives_the_same_gradients(single_process, grad_mode):
    ids, labels, doc_start = make_inputs()
    grads = {}
    for recompute in ("none", "selective", "full"):
        torch.manual_seed(0)
        model = build_model(tiny_model_config(**LLAMA, recompute=recompute), feedback(grad_mode=grad_mode)).train()
        model(ids, doc_start=doc_start, labels=labels, num_passes=3, jitter_seed=5).token_loss.sum().backward()
        grads[recompute] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for recompute in ("selective", "full"):
        for name, g in grads["none"].items():
            torch.testing.assert_close(grads[recompute][name], g, rtol=1e-5, atol=1e-6, msg=f"{recompute} {name}")
