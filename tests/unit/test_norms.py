"""RMSNorm on CPU in a few passes (fbt_megatron/model/norms.py).

The reference is the definition, ``x / sqrt(mean(x²) + eps) · w``, differentiated by autograd in float64;
then torch's own RMSNorm: the forward bitwise, the gradients to rounding, alone and in the whole model."""

import pytest
import torch

from fbt_megatron.model import norms
from fbt_megatron.model.fbt_gpt import build_model
from model_helpers import LLAMA, feedback, loss_and_grads, tiny_model_config


def rms_norm_from_definition(x, w, eps):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps) * w


def _value_and_grads(fn, x, w, grad):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(x, w)
    out.backward(grad)
    return out.detach(), x.grad, w.grad


def _inputs(dtype, shape=(5, 3, 16), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * 3 + 0.5
    w = torch.randn(shape[-1], generator=g, dtype=torch.float64)
    grad = torch.randn(*shape, generator=g, dtype=torch.float64)
    return x.to(dtype), w.to(dtype), grad.to(dtype)


def test_equals_the_definition_in_float64():
    x, w, grad = _inputs(torch.float64)
    ours = _value_and_grads(lambda x, w: norms.RMSNormFunction.apply(x, w, 1e-5), x, w, grad)
    reference = _value_and_grads(lambda x, w: rms_norm_from_definition(x, w, 1e-5), x, w, grad)
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_float32_forward_is_torchs_bitwise_and_gradients_agree():
    """On strided input and gradient, as the residual stream and a transposed upstream give them."""
    x, w, grad = _inputs(torch.float32, shape=(6, 4, 48), seed=1)
    x, grad = x.transpose(0, 1), grad.transpose(0, 1)
    ours = _value_and_grads(lambda x, w: norms.RMSNormFunction.apply(x, w, 1e-5), x, w, grad)
    torchs = _value_and_grads(lambda x, w: torch.nn.functional.rms_norm(x, (48,), w, 1e-5), x, w, grad)
    assert torch.equal(ours[0], torchs[0])
    torch.testing.assert_close(ours[1], torchs[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours[2], torchs[2], rtol=1e-5, atol=1e-5)
    x64, w64, grad64 = (t.double() for t in (x, w, grad))
    exact = _value_and_grads(lambda x, w: rms_norm_from_definition(x, w, 1e-5), x64, w64, grad64)
    for a, b in zip(ours, exact):  # both within float32 rounding of the exact value
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


def test_module_takes_the_cpu_path_with_torchs_parameters_and_eps():
    norm = norms.RMSNorm(16, eps=None)  # unset eps: torch's default, the dtype's machine epsilon
    assert isinstance(norm, torch.nn.RMSNorm) and list(norm.state_dict()) == ["weight"]
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 16))
    x = torch.randn(4, 2, 16) * 1e-4  # small enough that eps matters
    reference = torch.nn.RMSNorm(16, eps=None)
    reference.load_state_dict(norm.state_dict())
    out = norm(x)
    assert type(out.grad_fn).__name__ == "RMSNormFunctionBackward"  # the function, not torch's composite
    assert torch.equal(out, reference(x))


@pytest.mark.parametrize("case", ["bfloat16", "no_weight", "2d_shape"])
def test_other_cases_go_to_torch(case, monkeypatch):
    def refuse(*args):
        raise AssertionError("RMSNormFunction used")

    monkeypatch.setattr(norms.RMSNormFunction, "apply", refuse)
    x = torch.randn(3, 4, 8)
    if case == "bfloat16":
        norm, x = norms.RMSNorm(8).to(torch.bfloat16), x.to(torch.bfloat16)
    elif case == "no_weight":
        norm = norms.RMSNorm(8, elementwise_affine=False)
    else:
        norm = norms.RMSNorm((4, 8))
    reference = torch.nn.RMSNorm(norm.normalized_shape, elementwise_affine=norm.weight is not None).to(x.dtype)
    assert torch.equal(norm(x), reference(x))


def test_model_uses_it_and_trains_as_with_torchs_norm(single_process, monkeypatch):
    """The Llama-shaped model's every RMSNorm (layers and final) is this one; with torch's norm swapped
    back in, the same loss bitwise (3 passes) and every gradient to rounding."""
    torch.manual_seed(0)
    model = build_model(tiny_model_config(**LLAMA), feedback(fusion="glu"))
    rms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert len(rms) == 2 * LLAMA["num_layers"] + 1 and all(type(m) is norms.RMSNorm for m in rms)
    calls = []
    real_apply = norms.RMSNormFunction.apply
    monkeypatch.setattr(norms.RMSNormFunction, "apply", lambda *a: calls.append(1) or real_apply(*a))
    ours = loss_and_grads(model, 3)
    assert len(calls) == 3 * len(rms)  # every norm, in each of the 3 passes
    monkeypatch.setattr(norms.RMSNormFunction, "apply", real_apply)
    for m in rms:
        m.__class__ = torch.nn.RMSNorm
    torchs = loss_and_grads(model, 3)
    assert ours[1].keys() == torchs[1].keys() == {n for n, _ in model.named_parameters()}  # every parameter
    assert torch.equal(ours[0], torchs[0])
    for name, grad in ours[1].items():
        torch.testing.assert_close(grad, torchs[1][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("option", ["layernorm_zero_centered_gamma", "persist_layer_norm",
                                    "memory_efficient_layer_norm"])
def test_torch_norm_refuses_what_only_apex_or_te_norms_do(single_process, option):
    """What Megatron's WrappedTorchNorm asserts against, refused with the option's name (zero-centred gamma
    would otherwise be silently the wrong formula)."""
    from fbt_megatron.model.fbt_gpt import transformer_config

    config = transformer_config(tiny_model_config(**LLAMA))
    assert isinstance(norms.TorchNorm(config, 32), norms.RMSNorm)
    setattr(config, option, True)
    with pytest.raises(ValueError, match=option):
        norms.TorchNorm(config, 32)
