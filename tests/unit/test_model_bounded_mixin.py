"""The bounded prefix mixin (``feedback.mixin: bounded``): W_U is applied as W_U / max(1, sigma_max),
so the fused input's Jacobian in the fed-back state has spectral norm <= (1 - a) * max gate < 1 - a,
whatever the weights; the affine mixin does not bound it. References from the formula (exact SVD)."""

import pytest
import torch

from fbt_megatron.model.fbt_gpt import build_model
from fbt_megatron.model.sequential import sequential_forward
from tests.support.model_helpers import feedback, make_inputs, tiny_model_config

D = 32


def fusion(mixin, scale=5.0, a=0.3):
    torch.manual_seed(0)
    model = build_model(tiny_model_config(), feedback(mixin=mixin, prefix_mixin=a))
    with torch.no_grad():  # a W_U far outside the unit ball (sigma_max ~ scale * 2 sqrt(D) / sqrt(D))
        model.feedback.value.weight.copy_(torch.randn(D, D, generator=torch.Generator().manual_seed(3)) * scale / D ** 0.5)
    return model


def state_jacobian_norm(fb, h, e) -> float:
    """sigma_max of d x / d h for one position: x = fuse(fed_back(h), gate(e))."""
    gate = fb.token_gate(e.view(1, 1, -1))
    jac = torch.autograd.functional.jacobian(lambda s: fb.fuse(fb.fed_back(s.view(1, 1, -1)), gate).view(-1), h)
    return float(torch.linalg.matrix_norm(jac, ord=2))


def test_bounded_fusion_is_the_formula_in_eval_and_in_training(single_process):
    fb = fusion("bounded").feedback.eval()
    s, e = torch.randn(6, 2, D), torch.randn(6, 2, D)
    w = fb.value.weight.detach()
    sigma = torch.linalg.matrix_norm(w, ord=2)
    assert sigma > 2
    want = (s @ (w / sigma).T) * torch.sigmoid(e @ fb.gate.weight.detach().T)
    with torch.no_grad():
        torch.testing.assert_close(fb(s, e), want, rtol=1e-5, atol=1e-6)
    fb.train()
    for _ in range(60):  # the power iteration warms up over forwards
        out = fb(s, e)
    torch.testing.assert_close(out.detach(), want, rtol=1e-4, atol=1e-5)
    out.sum().backward()  # sigma carries gradient to W_U
    assert fb.value.weight.grad is not None and fb.value.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("a", [0.0, 0.1, 0.5])
def test_bounded_mixin_bounds_the_fed_back_path_and_affine_does_not(single_process, a):
    h, e = torch.randn(D), torch.randn(D)
    bounded = fusion("bounded", a=a).feedback.eval()
    norm = state_jacobian_norm(bounded, h, e)
    assert norm <= (1 - a) + 1e-5, norm
    affine = fusion("affine", a=a).feedback.eval()
    assert state_jacobian_norm(affine, h, e) > 1.5 * (1 - a)  # the same weights, unbounded
    # the clamp leaves a W_U inside the unit ball as it is
    small = fusion("bounded", scale=0.1, a=a).feedback.eval()
    same = fusion("affine", scale=0.1, a=a).feedback.eval()
    torch.testing.assert_close(state_jacobian_norm(small, h, e), state_jacobian_norm(same, h, e))


def test_bounded_model_is_the_recurrence_after_seq_len_passes(single_process):
    model = fusion("bounded").eval()
    ids, _, doc_start = make_inputs(seq=8)
    ref = sequential_forward(model, ids, doc_start=doc_start)  # W_U / sigma from torch.linalg.matrix_norm
    with torch.no_grad():
        out = model(ids, doc_start=doc_start, num_passes=8)
    torch.testing.assert_close(out.logits[..., :64], ref.logits[..., :64], rtol=1e-4, atol=1e-5)


def test_bounded_mixin_refused_with_zero3():
    from fbt_megatron.recipe import Recipe
    from tests.support.training import tiny_recipe

    with pytest.raises(ValueError, match="mixin='bounded' with parallel.zero_stage=3"):
        Recipe.model_validate(tiny_recipe("run", feedback={"mixin": "bounded"}, parallel={"zero_stage": 3}))


@pytest.mark.parametrize("mixin", ["bounded", "affine"])
def test_one_step_map_of_a_model_is_within_the_bound(single_process, mixin):
    """The whole one-step map d h_t / d h_{t-1} of a model (research/fixed_point's estimator) against
    the bound the mixin gives it: (1 - a) x the stack's own Jacobian d h_t / d x_t at the same point.
    The bounded mixin holds it for a W_U far outside the unit ball; the affine one does not."""
    from fbt_megatron.research.fixed_point import iterate_passes, one_step_jacobian_norms, stack_inputs
    from fbt_megatron.research.stability import power_spectral_norm

    a, t = 0.3, 5
    model = fusion(mixin, scale=8.0, a=a).eval()
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    top = iterate_passes(model, ids, 8)["top"]  # the exact recurrence's states
    one_step = one_step_jacobian_norms(model, ids, top, [t])[0]["spectral_norm"]
    fb = model.feedback
    with torch.no_grad():
        emb, mask, rotary, reset = stack_inputs(model, ids)
        x = fb.pass_input(top, emb, fb.token_gate(emb), reset)[: t + 1]

    def stack(x_t):  # x_t -> h_t, the earlier positions' inputs fixed
        return model.run_stack(torch.cat([x[:t], x_t.view(1, 1, -1)]), mask[..., : t + 1, : t + 1],
                               rotary[: t + 1])[-1, 0]

    bound = (1 - a) * power_spectral_norm(stack, x[t, 0])
    if mixin == "bounded":
        assert one_step <= 1.02 * bound, (one_step, bound)  # 2 %: the estimators' own error
    else:
        assert one_step > 1.5 * bound, (one_step, bound)


def test_eval_sigma_follows_updates_that_bypass_the_weights_version(single_process):
    """DeepSpeed's ZeRO-1/2 optimisers write updates through flat buffers (no version bump, same
    address): the next evaluation still divides by the new weight's spectral norm."""
    fb = fusion("bounded").feedback.eval()
    s, e = torch.randn(4, 1, D), torch.randn(4, 1, D)
    with torch.no_grad():
        fb(s, e)  # caches sigma
        fb.value.weight.data.mul_(3.0)  # as an optimiser step through a flat buffer
    fb.train()
    fb.eval()  # evaluate() switches modes around every validation
    w = fb.value.weight.detach()
    want = (s @ (w / torch.linalg.matrix_norm(w, ord=2)).T) * torch.sigmoid(e @ fb.gate.weight.detach().T)
    with torch.no_grad():
        torch.testing.assert_close(fb(s, e), want, rtol=1e-5, atol=1e-6)


def test_resuming_a_bounded_checkpoint_under_zero3_is_refused():
    """The recipe's own refusal holds for what a resumed run takes from its checkpoint."""
    from fbt_megatron.recipe import Recipe, RecipeError, adopt_checkpoint_rule
    from tests.support.training import tiny_recipe

    recipe = Recipe.model_validate(tiny_recipe("run", parallel={"zero_stage": 3}))
    saved = tiny_recipe("run", feedback={"mixin": "bounded"})
    with pytest.raises(RecipeError, match=r"(?s)trained with .*feedback.mixin='bounded'.*zero_stage=3"):
        adopt_checkpoint_rule(recipe, saved, "ckpt")


def test_the_first_training_forward_of_a_process_is_already_bounded(single_process):
    """A new run or a resume: the power iteration starts cold in the process, so its first training forward
    converges it (sigma to within 0.1 % here) and the bound holds from the first step, not after warm-up."""
    fb = fusion("bounded").feedback.train()
    s, e = torch.randn(6, 2, D), torch.randn(6, 2, D)
    w = fb.value.weight.detach()
    want = (s @ (w / torch.linalg.matrix_norm(w, ord=2)).T) * torch.sigmoid(e @ fb.gate.weight.detach().T)
    torch.testing.assert_close(fb(s, e).detach(), want, rtol=1e-3, atol=1e-4)


def test_eval_sigma_is_solved_once_per_weight_version(single_process, monkeypatch):
    """In eval mode (validation, decoding: a forward per token) sigma is a constant of the weights: the
    eigenproblem is solved on the first forward and again only after W_U changes (an optimiser step bumps
    its version) or after training, not once per forward."""
    fb = fusion("bounded").feedback.eval()
    solved = []
    eigvalsh = torch.linalg.eigvalsh

    def counting(*args, **kwargs):
        solved.append(1)
        return eigvalsh(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigvalsh", counting)
    s, e = torch.randn(4, 1, D), torch.randn(4, 1, D)
    with torch.no_grad():
        first = fb(s, e)
        for _ in range(5):  # five decoding steps on the same weights
            assert torch.equal(fb(s, e), first)
        assert len(solved) == 1, len(solved)
        fb.value.weight.mul_(2.0)  # an update in place: a new version of the weight
        fb(s, e)
        fb(s, e)
    assert len(solved) == 2, len(solved)


def test_the_training_estimate_follows_w_u_as_training_moves_it(single_process):
    """In training sigma is a power-iteration estimate warm from forward to forward (one iteration each):
    when the optimiser moves W_U (here step by step to an unrelated matrix of twice the scale), the
    estimate follows, and the fusion divides by the new weight's sigma, not by its norm along the old
    weight's top direction."""
    fb = fusion("bounded").feedback.train()
    s, e = torch.randn(6, 2, D), torch.randn(6, 2, D)
    fb(s, e)  # the first forward converges the estimate on the initial W_U
    start = fb.value.weight.detach().clone()
    target = torch.randn(D, D, generator=torch.Generator().manual_seed(11)) * 10.0 / D ** 0.5
    for step in range(1, 61):  # 20 steps from one weight to the other, then 40 at the new one
        with torch.no_grad():
            fb.value.weight.copy_(start + min(step / 20, 1.0) * (target - start))
        out = fb(s, e)
    w = fb.value.weight.detach()
    want = (s @ (w / torch.linalg.matrix_norm(w, ord=2)).T) * torch.sigmoid(e @ fb.gate.weight.detach().T)
    torch.testing.assert_close(out.detach(), want, rtol=1e-4, atol=1e-5)


def test_a_w_u_that_grows_out_of_the_unit_ball_in_training_is_bounded_once_it_does(single_process):
    """W_U starts well inside the unit ball (its depth-scaled init: sigma ~0.1, where the bound leaves it as
    it is) and training grows it past sigma 1 (here step by step to sigma ~10): from then on the fusion
    divides by its sigma, however long it stayed inside first."""
    torch.manual_seed(0)
    fb = build_model(tiny_model_config(), feedback(mixin="bounded", prefix_mixin=0.3)).feedback.train()
    s, e = torch.randn(6, 2, D), torch.randn(6, 2, D)
    start = fb.value.weight.detach().clone()
    assert torch.linalg.matrix_norm(start, ord=2) < 0.5

    def formula(w):
        sigma = torch.linalg.matrix_norm(w, ord=2)
        return (s @ (w / max(1.0, float(sigma))).T) * torch.sigmoid(e @ fb.gate.weight.detach().T)

    for _ in range(30):  # steps inside the unit ball: W_U applied as it is
        out = fb(s, e)
    torch.testing.assert_close(out.detach(), formula(start), rtol=1e-5, atol=1e-6)
    target = torch.randn(D, D, generator=torch.Generator().manual_seed(11)) * 5.0 / D ** 0.5
    for step in range(1, 61):  # 20 steps out of the ball, then 40 at the new weight
        with torch.no_grad():
            fb.value.weight.copy_(start + min(step / 20, 1.0) * (target - start))
        out = fb(s, e)
    w = fb.value.weight.detach()
    assert torch.linalg.matrix_norm(w, ord=2) > 5
    torch.testing.assert_close(out.detach(), formula(w), rtol=1e-4, atol=1e-5)


def test_the_power_iteration_vector_is_not_saved_with_the_model(single_process):
    """The power iteration's vector is process state (a start or a resume converges it afresh on its first
    training forward), not a weight: a bounded model's state dict holds what an affine model's does, so
    its checkpoints and exports carry the same tensors, and each model loads the other's state."""
    torch.manual_seed(0)
    bounded = build_model(tiny_model_config(), feedback(mixin="bounded"))
    affine = build_model(tiny_model_config(), feedback(mixin="affine"))
    bounded.feedback.train()(torch.randn(4, 1, D), torch.randn(4, 1, D))  # the vector exists and is warm
    assert bounded.state_dict().keys() == affine.state_dict().keys()
    bounded.load_state_dict(affine.state_dict())
    affine.load_state_dict(bounded.state_dict())
