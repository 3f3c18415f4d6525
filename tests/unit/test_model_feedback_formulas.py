"""The latent-feedback pieces that the sequential reference, the decoder and the pipeline reuse
(``LatentFeedback.fed_back``, ``token_gate``/``fuse``/``forward``, ``shift_states``), each against its
formula written out here from the module's own weights: a change to one of them cannot hide behind a
reference that calls the same code.

    fed back:  s = (1 - a) h + a h_init  (+ jitter_std * N(0, 1) in training, from the caller's generator)
    glu:       x = (W_U s + b_U) * sigmoid(W_G e + b_G)      additive: x = (W_U s + b_U) + (W_G e + b_G)
    shift:     position t receives s(h_{t-1}); position 0 and every document start receive h_init
"""

import pytest
import torch

from fbt_megatron.model.fbt_gpt import build_model
from tests.support.model_helpers import feedback, tiny_model_config

D = 32  # tiny_model_config's hidden size


def fusion(**overrides):
    torch.manual_seed(0)
    model = build_model(tiny_model_config(), feedback(**overrides))
    return model.feedback


def state(seq=6, batch=2, seed=1):
    return torch.randn(seq, batch, D, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mixin", [0.0, 0.3])
def test_fed_back_is_the_prefix_mixin_and_no_jitter_in_eval(single_process, mixin):
    fb = fusion(prefix_mixin=mixin, jitter_std=0.5).eval()
    h = state()
    want = (1 - mixin) * h + mixin * fb.initial_state.detach()
    torch.testing.assert_close(fb.fed_back(h), want, rtol=0, atol=1e-6)


def test_fed_back_jitter_is_gaussian_from_the_callers_generator(single_process):
    fb = fusion(prefix_mixin=0.3, jitter_std=0.5).train()
    h = state()
    noise = torch.randn(h.shape, generator=torch.Generator().manual_seed(7))
    want = 0.7 * h + 0.3 * fb.initial_state.detach() + 0.5 * noise
    torch.testing.assert_close(fb.fed_back(h, torch.Generator().manual_seed(7)), want, rtol=0, atol=1e-6)
    other = fb.fed_back(h, torch.Generator().manual_seed(8))
    assert (other - want).abs().max() > 0.1  # another seed, other noise


def test_no_jitter_at_std_zero_draws_no_random_numbers(single_process):
    """jitter_std 0 (the default) is jitter off: in training the fed-back state is the prefix mixin alone,
    and nothing is drawn, neither from the caller's generator nor from torch's global one (which the model
    passes when no jitter is on, and which the stack's dropout then draws from): a run without jitter keeps
    the random stream it would have without the feedback layer's noise code."""
    fb = fusion(prefix_mixin=0.3, jitter_std=0.0).train()
    h = state()
    want = 0.7 * h + 0.3 * fb.initial_state.detach()
    gen = torch.Generator().manual_seed(7)
    before = gen.get_state()
    torch.testing.assert_close(fb.fed_back(h, gen), want, rtol=0, atol=1e-6)
    assert torch.equal(gen.get_state(), before)  # the caller's generator: not advanced
    global_before = torch.get_rng_state()
    torch.testing.assert_close(fb.fed_back(h), want, rtol=0, atol=1e-6)
    assert torch.equal(torch.get_rng_state(), global_before)  # torch's global generator: not advanced either


@pytest.mark.parametrize("mode", ["glu", "additive"])
@pytest.mark.parametrize("bias", [False, True])
def test_fusion_is_the_formula(single_process, mode, bias):
    fb = fusion(fusion=mode, bias=bias).eval()
    with torch.no_grad():  # nonzero biases, so a dropped bias shows
        for lin in (fb.value, fb.gate):
            if lin.bias is not None:
                lin.bias.normal_(0.0, 0.5)
    s, e = state(seed=1), state(seed=2)
    w_u, w_g = fb.value.weight.detach(), fb.gate.weight.detach()
    value = s @ w_u.T + (fb.value.bias.detach() if bias else 0.0)
    gate = e @ w_g.T + (fb.gate.bias.detach() if bias else 0.0)
    want = value * torch.sigmoid(gate) if mode == "glu" else value + gate
    torch.testing.assert_close(fb(s, e), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fb.fuse(s, fb.token_gate(e)), want, rtol=1e-5, atol=1e-6)
    # a [1, 1, D] state (pass 1's h_init) broadcasts over every position
    h0 = fb.initial_states()
    want0 = (h0 @ w_u.T + (fb.value.bias.detach() if bias else 0.0)).expand_as(gate)
    want0 = want0 * torch.sigmoid(gate) if mode == "glu" else want0 + gate
    torch.testing.assert_close(fb.fuse(h0, fb.token_gate(e)), want0, rtol=1e-5, atol=1e-6)


def test_shift_gives_each_position_the_previous_state_and_resets_at_document_starts(single_process):
    fb = fusion(prefix_mixin=0.3).eval()
    h = state(seq=7, batch=2)
    reset = torch.zeros(7, 2, dtype=torch.bool)
    reset[0] = True
    reset[4, 0] = reset[2, 1] = reset[3, 1] = True  # document starts (two in a row in column 1)
    h0 = fb.initial_state.detach()
    want = torch.empty_like(h)
    for t in range(7):
        for b in range(2):
            want[t, b] = h0 if reset[t, b] else 0.7 * h[t - 1, b] + 0.3 * h0
    torch.testing.assert_close(fb.shift_states(h, reset), want, rtol=0, atol=1e-6)


def test_jitter_of_rows_laid_end_to_end_is_the_rows_jitter(single_process):
    """Packed attention under sequence parallelism lays a micro-batch's B rows end to end as one row
    ([B*S, 1, D]); the jitter is then the rows' own [S, B, D] draw laid the same way, so both layouts train
    alike. A batch of one row (micro_batch_size 1) draws as any batch."""
    fb = fusion(prefix_mixin=0.3, jitter_std=0.5).train()
    h = state(seq=6, batch=3)
    rows = fb.fed_back(h, torch.Generator().manual_seed(7))  # [S, B, D], the formula: the test above
    fb.rows_as_one = 3
    laid = fb.fed_back(h.transpose(0, 1).reshape(18, 1, D), torch.Generator().manual_seed(7))
    torch.testing.assert_close(laid, rows.transpose(0, 1).reshape(18, 1, D), rtol=0, atol=1e-6)
    fb.rows_as_one = None
    one = h[:, :1]
    noise = torch.randn(one.shape, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(fb.fed_back(one, torch.Generator().manual_seed(7)),
                               0.7 * one + 0.3 * fb.initial_state.detach() + 0.5 * noise, rtol=0, atol=1e-6)


@pytest.mark.parametrize("depth_scaling", [True, False])
def test_normal_init_scales(single_process, depth_scaling):
    """value_init normal: W_U ~ N(0, std / sqrt(2 L)) with depth scaling, N(0, std) without (std the
    model's init_method_std, L its layers); gate_init unit_spread: W_G ~ N(0, 1 / (sqrt(D) std)), so W_G e
    of a unit-spread embedding (entries ~ N(0, std)) has unit spread; gate_init normal: N(0, std)."""
    cfg = tiny_model_config()
    std, layers = cfg.init_method_std, cfg.num_layers
    for gate_init, gate_std in (("unit_spread", 1.0 / (D ** 0.5 * std)), ("normal", std)):
        fb = fusion(value_init="normal", depth_scaling=depth_scaling, gate_init=gate_init)
        value_std = std / (2 * layers) ** 0.5 if depth_scaling else std
        # D * D = 1024 draws: the sample std is within ~2 % (one standard error) of the true one
        assert abs(float(fb.value.weight.std()) / value_std - 1) < 0.1, (float(fb.value.weight.std()), value_std)
        assert abs(float(fb.gate.weight.std()) / gate_std - 1) < 0.1, (gate_init, float(fb.gate.weight.std()))
        # and both are centred: the mean of D * D = 1024 zero-mean draws is within 4 standard errors of 0
        assert abs(float(fb.value.weight.mean())) < 4 * value_std / D, float(fb.value.weight.mean())
        assert abs(float(fb.gate.weight.mean())) < 4 * gate_std / D, (gate_init, float(fb.gate.weight.mean()))


def test_h_init_starts_as_a_unit_normal_draw(single_process):
    """h_init (the prefix mixin's anchor, and the state fed where none exists under first_input=state)
    starts at the scale of the state it stands in for, a final-layernorm output: entries N(0, 1), so mean
    about 0 and root mean square about 1. Four models (4 * D = 128 draws): within 4 standard errors."""
    draws = []
    for seed in range(4):
        torch.manual_seed(seed)  # build_model draws its init seed from torch's global generator
        model = build_model(tiny_model_config(), feedback(prefix_mixin=0.3))
        draws.append(model.feedback.initial_state.detach())
    h0 = torch.cat(draws)
    n = h0.numel()
    assert abs(float(h0.mean())) < 4 / n ** 0.5, float(h0.mean())
    rms = float(h0.square().mean().sqrt())
    assert abs(rms - 1) < 4 / (2 * n) ** 0.5, rms  # the sample RMS of n unit normals: standard error 1/sqrt(2n)
