"""The CPU replacements of Megatron's functions (RoPE rotation, the loss's maximum and one-rank loss,
SwiGLU, one-rank linear layers and mappings) are installed on the CPU path only: on any other device
Megatron's (and TE's) own functions run. The RMSNorm backward replacement decides per tensor (CPU only)."""

import megatron.core.tensor_parallel as megatron_tp
import pytest
import torch
from megatron.core.tensor_parallel import layers as megatron_layers
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from megatron.core.transformer import attention as megatron_attention
from megatron.core.transformer import mlp as megatron_mlp

from fbt_megatron import runtime
from fbt_megatron.model import cross_entropy, fbt_gpt, norms, one_rank_linear, rope, swiglu

# (where Megatron looks it up, the name, Megatron's own function, ours)
LOOKUPS = [
    (megatron_attention, "apply_rotary_pos_emb", rope.MEGATRON_APPLY, rope.apply_rotary_pos_emb),
    (megatron_tp, "vocab_parallel_cross_entropy", cross_entropy.MEGATRON_CROSS_ENTROPY,
     cross_entropy.vocab_parallel_cross_entropy),
    (megatron_mlp, "bias_swiglu_impl", swiglu.MEGATRON_BIAS_SWIGLU, swiglu.bias_swiglu_impl),
    (megatron_layers, "linear_with_grad_accumulation_and_async_allreduce", one_rank_linear.MEGATRON_LINEAR,
     one_rank_linear.linear_with_grad_accumulation_and_async_allreduce),
    (megatron_layers, "copy_to_tensor_model_parallel_region", one_rank_linear.MEGATRON_COPY_TO,
     one_rank_linear.copy_to_tensor_model_parallel_region),
    (megatron_layers, "reduce_from_tensor_model_parallel_region", one_rank_linear.MEGATRON_REDUCE_FROM,
     one_rank_linear.reduce_from_tensor_model_parallel_region),
]


def megatrons_own(monkeypatch):
    """Every lookup point back to Megatron's own function for this test (restored afterwards)."""
    for module, name, megatron_fn, _ in LOOKUPS:
        monkeypatch.setattr(module, name, megatron_fn)
    monkeypatch.setattr(VocabParallelCrossEntropy, "calculate_logits_max",
                        staticmethod(cross_entropy.MEGATRON_LOGITS_MAX))


@pytest.mark.parametrize("on_cuda", [True, False])
def test_replacements_only_on_the_cpu_path(monkeypatch, on_cuda):
    megatrons_own(monkeypatch)
    monkeypatch.setattr(runtime, "use_cuda", lambda: on_cuda)
    fbt_gpt.install_cpu_replacements()
    for module, name, megatron_fn, ours in LOOKUPS:
        assert getattr(module, name) is (megatron_fn if on_cuda else ours), (name, on_cuda)
    max_fn = VocabParallelCrossEntropy.calculate_logits_max
    assert max_fn is (cross_entropy.MEGATRON_LOGITS_MAX if on_cuda else cross_entropy.calculate_logits_max)


def test_the_model_installs_them_through_the_device_gate(monkeypatch, single_process):
    """Building a model goes through install_cpu_replacements and calls no module's install itself."""
    from model_helpers import feedback, tiny_model_config

    calls = []
    monkeypatch.setattr(fbt_gpt, "install_cpu_replacements", lambda: calls.append("gate"))
    for module in (rope, cross_entropy, swiglu, one_rank_linear):
        monkeypatch.setattr(module, "install", lambda m=module: pytest.fail(f"{m.__name__}.install called directly"))
    fbt_gpt.build_model(tiny_model_config(), feedback())
    assert calls == ["gate"]


def test_rmsnorm_replacement_is_cpu_only():
    """The closed-form backward runs for CPU tensors only: anything else is torch's RMSNorm (checked with a
    meta tensor, a non-CPU device every machine has)."""
    norm = norms.RMSNorm(8, eps=1e-5)
    x = torch.randn(3, 8, requires_grad=True)
    assert norm(x).grad_fn.name().startswith("RMSNormFunction")
    meta = norms.RMSNorm(8, eps=1e-5, device="meta")
    assert not meta(torch.empty(3, 8, device="meta")).grad_fn.name().startswith("RMSNormFunction")
