"""Through ``forward``: the state restarts at every document start, ``grad_mode="last"`` is exactly the
last pass with the earlier passes' states detached, and the one incoherent loss/gradient combination
is refused."""

import pytest
import torch
from pydantic import ValidationError

from fbt_megatron.model.fbt_gpt import build_model, reset_positions
from model_helpers import feedback, make_inputs, tiny_model_config


def stack_inputs_per_pass(model, ids, doc_start, k):
    """The decoder's input of every pass of one forward (captured by a forward pre-hook)."""
    captured = []
    handle = model.gpt.decoder.register_forward_pre_hook(
        lambda module, args, kwargs: captured.append(kwargs["hidden_states"].detach().clone()), with_kwargs=True)
    try:
        with torch.no_grad():
            model(ids, doc_start=doc_start, num_passes=k)
    finally:
        handle.remove()
    return captured


@pytest.mark.parametrize("attention_mask", ["causal", "document_causal"])
def test_forward_feeds_h_init_at_every_document_start(single_process, attention_mask):
    """Pass 2's stack input at a document start is fuse(h_init, e_t), not fuse(h_{t-1}, e_t); elsewhere it
    is the fed-back state. Fails if forward's reset ignored ``doc_start``."""
    torch.manual_seed(0)
    model = build_model(tiny_model_config(attention_mask=attention_mask), feedback()).eval()
    ids, _, doc_start = make_inputs(seq=10)
    first, second = stack_inputs_per_pass(model, ids, doc_start, 2)
    reset = reset_positions(doc_start, 2, 10, ids.device)  # [S, B]
    with torch.no_grad():
        mask, positions = model.attention_inputs(reset)
        embedded = model.gpt.embedding(input_ids=ids, position_ids=positions)
        h_init_input = model.feedback(model.feedback.initial_states(), embedded)  # pass 1 = h_init everywhere
    torch.testing.assert_close(first, h_init_input, rtol=0, atol=0)
    starts = doc_start.t().clone()  # [S, B], from the inputs, not from the model's helper
    starts[0] = True
    assert starts.sum() == 5  # position 0 of both rows and the three packed document starts
    torch.testing.assert_close(second[starts], h_init_input[starts], rtol=1e-6, atol=1e-6)
    assert (second[~starts] - h_init_input[~starts]).norm(dim=-1).min() > 1e-4  # others got a fed-back state


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
    state = model.feedback.shift_states(top, reset)
    top_last = model.run_stack(model.feedback(state, embedded), mask, model.rotary(positions))
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
