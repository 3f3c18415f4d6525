"""SwiGLU on CPU through Megatron's fused switch (fbt_megatron/model/swiglu.py).

The reference is SwiGLU's definition, ``x_1 sigmoid(x_1) x_2`` and its derivatives written out, in float64;
then Megatron-Core's unfused MLP path: the fused switch on CPU must give its output, input gradient and
weight gradients bitwise, in the MLP and in the whole model (k passes, with and without recompute, with
biases); GPU tensors go to Megatron's compiled function untouched."""

import dataclasses
import inspect

import megatron.core
import pytest
import torch
from megatron.core.transformer import mlp as megatron_mlp

from fbt_megatron.model import swiglu
from fbt_megatron.model.fbt_gpt import build_model
from model_helpers import LLAMA, feedback, loss_and_grads, tiny_model_config


def test_equals_the_definition_in_float64():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 3, 14, generator=g, dtype=torch.float64) * 3).requires_grad_()
    grad = torch.randn(5, 3, 7, generator=g, dtype=torch.float64)
    out = swiglu.bias_swiglu_impl(x, None)
    out.backward(grad)
    x1, x2 = x.detach()[..., :7], x.detach()[..., 7:]
    s = torch.sigmoid(x1)
    assert torch.allclose(out, x1 * s * x2, rtol=1e-13, atol=1e-13)
    d1 = grad * x2 * (s + x1 * s * (1 - s))  # d/dx_1 of x_1 sigmoid(x_1) x_2
    d2 = grad * x1 * s
    assert torch.allclose(x.grad, torch.cat([d1, d2], -1), rtol=1e-13, atol=1e-13)


def test_bias_is_added_first_and_gets_its_gradient():
    g = torch.Generator().manual_seed(1)
    x, bias = torch.randn(4, 2, 10, generator=g), torch.randn(10, generator=g)
    grads = []
    for fn in (lambda x, b: swiglu.bias_swiglu_impl(x, b), lambda x, b: unfused(x + b)):
        xi, bi = x.clone().requires_grad_(), bias.clone().requires_grad_()
        out = fn(xi, bi)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        grads.append((out, xi.grad, bi.grad))
    for ours, theirs in zip(*grads):
        assert torch.equal(ours, theirs)


def unfused(x):
    """Megatron's unfused MLP activation (mlp.py, ``glu``) with glu_linear_offset 0.0."""
    x_glu, x_linear = torch.chunk(x, 2, dim=-1)
    return torch.nn.functional.silu(x_glu) * (x_linear + 0.0)


def _mlp_run(mlp, x, fused):
    mlp.config.bias_activation_fusion = fused
    mlp.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    out, out_bias = mlp(xi)
    out = out if out_bias is None else out + out_bias  # fc2's bias is left to the layer's residual add
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return [out.detach(), xi.grad] + [p.grad.clone() for p in mlp.parameters()]


@pytest.mark.parametrize("bias", [False, True])
def test_megatron_mlp_fused_on_cpu_equals_unfused_bitwise(single_process, bias):
    model = build_model(tiny_model_config(**{**LLAMA, "add_bias_linear": bias}), feedback())
    assert megatron_mlp.bias_swiglu_impl is swiglu.bias_swiglu_impl  # installed by the model
    mlp = model.gpt.decoder.layers[0].mlp
    assert isinstance(mlp, megatron_mlp.MLP) and model.config.bias_activation_fusion  # the switch is on on CPU
    mlp.config = dataclasses.replace(mlp.config)  # toggled below: not the model's shared config
    x = torch.randn(6, 2, LLAMA["hidden_size"], generator=torch.Generator().manual_seed(2))
    fused, plain = _mlp_run(mlp, x, True), _mlp_run(mlp, x, False)
    assert len(fused) == (6 if bias else 4)  # output, input gradient, fc1 and fc2 weights (and biases)
    for ours, theirs in zip(fused, plain):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("num_passes,recompute", [(1, "none"), (3, "full")])
def test_model_equals_the_unfused_path_bitwise(single_process, num_passes, recompute):
    torch.manual_seed(0)
    model = build_model(tiny_model_config(**LLAMA, recompute=recompute), feedback(fusion="glu"))
    config = model.config
    assert config.bias_activation_fusion
    fused = loss_and_grads(model, num_passes)
    config.bias_activation_fusion = False  # the layers share the model's config
    try:
        plain = loss_and_grads(model, num_passes)
    finally:
        config.bias_activation_fusion = True
    assert torch.equal(fused[0], plain[0]) and fused[1].keys() == plain[1].keys()
    for name in fused[1]:
        assert torch.equal(fused[1][name], plain[1][name]), name


def test_other_devices_go_to_megatron(monkeypatch):
    calls = []
    monkeypatch.setattr(swiglu, "MEGATRON_BIAS_SWIGLU", lambda *args: calls.append(args) or "megatron")
    x, bias = torch.empty(3, 2, 8, device="meta"), torch.empty(8, device="meta")
    assert swiglu.bias_swiglu_impl(x, bias, True, False) == "megatron"
    assert calls == [(x, bias, True, False)]


def test_fp8_input_store_is_refused_on_cpu():
    with pytest.raises(ValueError, match="activation_func_fp8_input_store.*GPU-only"):
        swiglu.bias_swiglu_impl(torch.randn(2, 8), None, fp8_input_store=True)


def test_written_for_this_megatron_core():
    """The replacement takes Megatron's place by name and signature, and the MLP's fused branch is the one
    that calls it: an upgrade that changes either must be checked again (pyproject pins 0.16.x)."""
    assert megatron.core.__version__.startswith("0.16."), megatron.core.__version__
    assert list(inspect.signature(swiglu.MEGATRON_BIAS_SWIGLU).parameters) == \
        list(inspect.signature(swiglu.bias_swiglu_impl).parameters)
    assert "intermediate_parallel = bias_swiglu_impl(" in inspect.getsource(megatron_mlp.MLP.forward)
