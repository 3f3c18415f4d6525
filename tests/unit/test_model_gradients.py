"""Through ``forward``: ``grad_mode="last"`` is exactly the last pass with the earlier passes' states
detached, and the one incoherent loss/gradient combination is refused. (What each pass feeds the stack
is checked against the formulas in test_model_first_pass.py.)"""

import pytest
import torch
from pydantic import ValidationError

from fbt_megatron.model.fbt_gpt import build_model, reset_positions
from tests.support.model_helpers import feedback, make_inputs, tiny_model_config


def test_grad_mode_last_is_the_last_pass_with_earlier_states_detached(single_process):
    torch.manual_seed(0)
    model = build_model(tiny_model_config(), feedback(grad_mode="last", jitter_std=0.0))
    ids, labels, doc_start = make_inputs()
    k = 3
    model.zero_grad()
    out = model(ids, doc_start=doc_start, labels=labels, num_passes=k)
    out.token_loss.sum().backward()
    automatic = {n: p.grad.clone() for n, p in model.named_parameters()}

    # By hand: passes 1..k-1 without gradient give the top state; the last pass is rebuilt from the
    # model's pieces with gradient, its fed-back states entering as constants.
    model.zero_grad()
    with torch.no_grad():
        top = model(ids, doc_start=doc_start, num_passes=k - 1).hidden.detach()
    reset = reset_positions(doc_start, *ids.shape, ids.device)
    mask, positions = model.attention_inputs(reset)
    embedded = model.gpt.embedding(input_ids=ids, position_ids=positions)
    # The last pass's input by the formula: e_t at document starts, fuse((1-a) h_{t-1} + a h_init, e_t) elsewhere.
    a, fb = model.feedback_config.prefix_mixin, model.feedback
    fed = (1 - a) * torch.cat([top[:1], top[:-1]]) + a * fb.initial_state
    fused = torch.nn.functional.linear(fed, fb.value.weight) * torch.sigmoid(
        torch.nn.functional.linear(embedded, fb.gate.weight))
    stack_input = torch.where(reset.unsqueeze(-1), embedded, fused)
    top_last = model.run_stack(stack_input, mask, model.rotary(positions))
    manual_loss = model.head(top_last, labels)
    torch.testing.assert_close(out.token_loss.detach(), manual_loss.detach(), rtol=1e-6, atol=1e-6)
    manual_loss.sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(automatic[name], p.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    # h_init and W_U reach the last pass's loss only through its own shift (not through earlier passes).
    assert automatic["feedback.value.weight"].abs().sum() > 0


def test_mean_loss_with_last_pass_gradient_is_refused():
    with pytest.raises(ValidationError, match=r"loss_on='mean' needs feedback.grad_mode='all'"):
        feedback(grad_mode="last", loss_on="mean")
    feedback(grad_mode="all", loss_on="mean")  # the coherent combinations are accepted
    feedback(grad_mode="last", loss_on="last")
