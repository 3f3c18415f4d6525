"""RoPE with cos/sin computed once per forward: the ``rope`` CPU fast path (fbt_megatron/model/cpu_fastpaths.py).

The reference is RoPE's definition (each pair (x_i, x_{i+D/2}) rotated by the angle of its frequency),
then Megatron-Core's own function: the cached path must give its values and gradients bitwise, in the
layer and in the whole model, and hand every case it does not take to it."""

import pytest
import torch
from megatron.core.transformer import attention as megatron_attention

from fbt_megatron.model import cpu_fastpaths as room
from fbt_megatron.model.fbt_gpt import build_model, transformer_config
from tests.support.model_helpers import LLAMA, feedback, loss_and_grads, tiny_model_config


def rope_from_definition(t, angles):
    """x_i cos a_i - x_{i+D/2} sin a_i and x_{i+D/2} cos a_i + x_i sin a_i, a = angles[..., :D/2]."""
    half = t.shape[-1] // 2
    a = angles[..., :half]
    x1, x2 = t[..., :half], t[..., half:]
    return torch.cat([x1 * a.cos() - x2 * a.sin(), x2 * a.cos() + x1 * a.sin()], dim=-1)


def frequencies(s, b, d, seed=0):
    """[S, B, 1, D] angles as Megatron lays them out (the D/2 frequencies twice)."""
    g = torch.Generator().manual_seed(seed)
    half = torch.rand(s, b, 1, d // 2, generator=g) * 6.0
    return torch.cat([half, half], dim=-1)


@pytest.fixture
def config(single_process):
    return transformer_config(tiny_model_config(**LLAMA))


def test_equals_the_definition_and_megatron_bitwise(config):
    s, b, heads, d = 7, 3, 4, 8
    freqs = frequencies(s, b, d)
    base = torch.randn(s, b, 3 * heads, d)
    outs, grads = [], []
    for fn in (room.apply_rotary_pos_emb, room.MEGATRON_APPLY_ROPE):
        mixed = base.clone().requires_grad_()
        q = mixed[:, :, :heads]  # a strided view, as Megatron's split of the fused QKV projection gives
        out = fn(q, freqs, config=config)
        out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
        outs.append(out)
        grads.append(mixed.grad)
    torch.testing.assert_close(outs[0], rope_from_definition(base[:, :, :heads], freqs), rtol=0, atol=1e-6)
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])
    assert type(outs[0].grad_fn).__name__ == "_RotateBackward"  # the short way, called as Megatron's attention does


def test_rotation_equals_megatrons_expression_for_any_cos_sin():
    """The half-by-half rotation against Megatron's expression written out, ``t·cos + [-t_2, t_1]·sin``,
    with cos and sin whose halves differ (Megatron's tables repeat them, which would hide a swapped half),
    on a strided view: values and the gradient bitwise."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(6, 2, 9, 8, generator=g)
    cos, sin = torch.randn(6, 2, 1, 8, generator=g), torch.randn(6, 2, 1, 8, generator=g)
    grad = torch.randn(6, 2, 3, 8, generator=g)
    results = []
    for fn in (lambda t: room._Rotate.apply(t, cos, sin),
               lambda t: t * cos + torch.cat((-t[..., 4:], t[..., :4]), dim=-1) * sin):
        mixed = base.clone().requires_grad_()
        out = fn(mixed[:, :, 3:6])
        out.backward(grad)
        results.append((out.detach(), mixed.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_a_new_frequency_tensor_is_not_served_from_the_cache(config):
    t = torch.randn(5, 2, 2, 8)
    first, second = frequencies(5, 2, 8, seed=1), frequencies(5, 2, 8, seed=2)
    assert torch.equal(room.apply_rotary_pos_emb(t, first, config=config), rope_from_definition(t, first))
    assert torch.equal(room.apply_rotary_pos_emb(t, second, config=config), rope_from_definition(t, second))
    second.mul_(0.5)  # changed in place: a new version of the same tensor
    torch.testing.assert_close(room.apply_rotary_pos_emb(t, second, config=config), rope_from_definition(t, second),
                               rtol=0, atol=1e-6)
    # a fresh tensor each call, freed after it: the allocator hands out the same address (and id) again
    for seed in range(20):
        out = room.apply_rotary_pos_emb(t, frequencies(5, 2, 8, seed=100 + seed), config=config)
        torch.testing.assert_close(out, rope_from_definition(t, frequencies(5, 2, 8, seed=100 + seed)),
                                   rtol=0, atol=1e-6)


def test_each_dtype_gets_its_own_cos_sin(config):
    """The same angles for a float64 then a bfloat16 tensor: each is Megatron's result in its own dtype
    (a float64 cos served to bfloat16 would promote the result)."""
    freqs = frequencies(5, 2, 8, seed=3)
    t = torch.randn(5, 2, 2, 8, dtype=torch.float64)
    for dtype in (torch.float64, torch.bfloat16, torch.float32):
        x = t.to(dtype)
        out = room.apply_rotary_pos_emb(x, freqs, config=config)
        assert out.dtype == dtype
        assert torch.equal(out, room.MEGATRON_APPLY_ROPE(x, freqs, config=config))


def test_inference_mode_tensors(config):
    """Tensors made under torch.inference_mode have no version counter: computed, not cached."""
    with torch.inference_mode():
        t, freqs = torch.randn(5, 2, 2, 8), frequencies(5, 2, 8, seed=4)
        assert torch.equal(room.apply_rotary_pos_emb(t, freqs, config=config), room.MEGATRON_APPLY_ROPE(t, freqs, config=config))


def test_inference_mode_leaves_nothing_for_training(config):
    """cos/sin computed under torch.inference_mode are inference tensors: kept, they would reach a later
    training call with the same frequencies, which cannot save them for backward."""
    freqs = frequencies(5, 2, 8, seed=5)
    t = torch.randn(5, 2, 2, 8)
    with torch.inference_mode():
        room.apply_rotary_pos_emb(t, freqs, config=config)
    x = t.clone().requires_grad_()
    out = room.apply_rotary_pos_emb(x, freqs, config=config)
    out.sum().backward()
    ref = t.clone().requires_grad_()
    room.MEGATRON_APPLY_ROPE(ref, freqs, config=config).sum().backward()
    assert torch.equal(out, room.MEGATRON_APPLY_ROPE(t, freqs, config=config)) and torch.equal(x.grad, ref.grad)


@pytest.mark.parametrize("case", ["cu_seqlens", "interleaved", "mscale", "partial", "fusion", "mla", "freqs_grad"])
def test_other_cases_go_to_megatron(config, case, monkeypatch):
    calls = []

    def megatron_apply(*args, **kwargs):
        calls.append(kwargs)
        return "megatron"

    monkeypatch.setattr(room, "MEGATRON_APPLY_ROPE", megatron_apply)
    t, freqs, kwargs = torch.randn(6, 1, 2, 8), frequencies(6, 1, 8), {}
    if case == "cu_seqlens":
        kwargs["cu_seqlens"] = torch.tensor([0, 3, 6], dtype=torch.int32)
    elif case == "interleaved":
        config.rotary_interleaved = True
    elif case == "mscale":
        kwargs["mscale"] = 1.5
    elif case == "partial":
        freqs = freqs[..., :4]  # rotary_percent < 1: part of each head passes through
    elif case == "fusion":
        config.apply_rope_fusion = True
    elif case == "mla":
        config.multi_latent_attention = True
    else:
        freqs.requires_grad_()  # its gradient is Megatron's to compute
    assert room.apply_rotary_pos_emb(t, freqs, config=config, **kwargs) == "megatron" and len(calls) == 1


@pytest.mark.parametrize("num_passes,recompute", [(1, "none"), (3, "none"), (3, "full")])
def test_model_equals_megatron_rope_and_computes_cos_once(single_process, monkeypatch, num_passes, recompute):
    """The whole model (Llama-shaped, document-causal, k passes, with and without full activation
    recompute): loss and every gradient bitwise equal with Megatron's own RoPE; cos is computed once per
    forward and backward instead of twice per layer and pass (and again in recompute)."""
    torch.manual_seed(0)
    model = build_model(tiny_model_config(**LLAMA, recompute=recompute), feedback(fusion="glu"))
    assert megatron_attention.apply_rotary_pos_emb is room.apply_rotary_pos_emb  # installed by the model
    cos_calls = []
    real_cos = torch.cos
    monkeypatch.setattr(torch, "cos", lambda x: cos_calls.append(1) or real_cos(x))
    ours = loss_and_grads(model, num_passes)
    assert len(cos_calls) == 1
    monkeypatch.setattr(megatron_attention, "apply_rotary_pos_emb", room.MEGATRON_APPLY_ROPE)
    cos_calls.clear()
    theirs = loss_and_grads(model, num_passes)
    recomputed = 2 if recompute == "full" else 1  # the forward, then again in backward
    assert len(cos_calls) == 2 * LLAMA["num_layers"] * num_passes * recomputed  # q and k, every layer and pass
    assert torch.equal(ours[0], theirs[0])
    assert ours[1].keys() == theirs[1].keys()
    for name in ours[1]:
        assert torch.equal(ours[1][name], theirs[1][name]), name
