"""Multi-pass teacher forcing is Jacobi iteration of the true recurrence: check it, don't assume it."""

import pytest
import torch

from fbt_megatron.model.fbt_gpt import build_model
from fbt_megatron.model.sequential import sequential_forward
from tests.support.model_helpers import LLAMA, feedback, make_inputs, tiny_model_config

SEQ = 10


def rel_err_per_position(a, b, vocab=64):
    """[B, S, V] -> max over batch of ||a-b|| / ||b|| per position (logical vocabulary; padding is -inf)."""
    a, b = a[..., :vocab], b[..., :vocab]
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).amax(0)


@pytest.fixture(params=["gpt", "llama"])
def model_and_reference(single_process, request):
    torch.manual_seed(0)
    cfg = tiny_model_config() if request.param == "gpt" else tiny_model_config(**LLAMA)
    model = build_model(cfg, feedback()).eval()
    ids, _, doc_start = make_inputs(seq=SEQ)
    return model, ids, doc_start


@pytest.mark.parametrize("packed", [False, True], ids=["one-doc", "packed-docs"])
def test_k_passes_match_recurrence_on_first_k_positions(model_and_reference, packed):
    model, ids, doc_start = model_and_reference
    doc_start = doc_start if packed else None
    ref = sequential_forward(model, ids, doc_start=doc_start)
    for k in (1, 2, 3, 5):
        with torch.no_grad():
            out = model(ids, doc_start=doc_start, num_passes=k)
        err = rel_err_per_position(out.logits, ref.logits)
        assert err[:k].max() <= 1e-5, (k, err)
        # ...and it is a real iteration: positions beyond k have not converged yet.
        if not packed and k < SEQ:
            assert err[k:].max() > 1e-3, (k, err)


@pytest.mark.parametrize("packed", [False, True], ids=["one-doc", "packed-docs"])
def test_k_at_least_sequence_length_is_the_recurrence(model_and_reference, packed):
    model, ids, doc_start = model_and_reference
    doc_start = doc_start if packed else None
    ref = sequential_forward(model, ids, doc_start=doc_start)
    with torch.no_grad():
        out = model(ids, doc_start=doc_start, num_passes=SEQ)
    assert rel_err_per_position(out.logits, ref.logits).max() <= 1e-5
    assert ((out.hidden - ref.hidden).norm() / ref.hidden.norm()) <= 1e-5


@pytest.mark.parametrize("first_input", ["embedding", "state"])
def test_jacobi_exact_per_document(single_process, first_input):
    """After k passes the first k positions of EVERY packed document equal the recurrence (k = 1, 2, 3,
    5, S), under both pass-input rules; later positions have not converged."""
    torch.manual_seed(0)
    model = build_model(tiny_model_config(), feedback(first_input=first_input)).eval()
    with torch.no_grad():  # a fed-back state that matters
        model.feedback.value.weight.normal_(0.0, 0.3)
    ids, _, doc_start = make_inputs(seq=SEQ)  # row 0: documents at 0, 4; row 1: at 0, 3, 7
    in_doc = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2, 3, 0, 1, 2]])  # by hand
    ref = sequential_forward(model, ids, doc_start=doc_start)
    for k in (1, 2, 3, 5, SEQ):
        with torch.no_grad():
            out = model(ids, doc_start=doc_start, num_passes=k)
        a, b = out.logits[..., :64], ref.logits[..., :64]
        err = (a - b).norm(dim=-1) / b.norm(dim=-1)  # [B, S]
        assert err[in_doc < k].max() <= 1e-5, (k, err)
        if (in_doc >= k).any():
            assert err[in_doc >= k].min() > 1e-4, (k, err)


def test_gradient_modes_differ_only_in_earlier_passes(single_process):
    torch.manual_seed(0)
    ids, labels, doc_start = make_inputs()
    grads = {}
    for mode in ("all", "last"):
        torch.manual_seed(0)
        model = build_model(tiny_model_config(), feedback(grad_mode=mode, jitter_std=0.0))
        out = model(ids, doc_start=doc_start, labels=labels, num_passes=3)
        out.token_loss.mean().backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
        losses = out.token_loss.detach()
        grads[mode + "_loss"] = losses
    assert torch.equal(grads["all_loss"], grads["last_loss"])  # same forward
    differs = [n for n in grads["all"] if not torch.allclose(grads["all"][n], grads["last"][n])]
    assert "feedback.value.weight" in differs  # W_U gets gradient through earlier passes only in "all"


def test_pass_residuals_are_the_relative_change_of_the_top_state(single_process):
    """``pass_residuals[k-1]`` = ||h_{k+1} - h_k|| / ||h_k||, h_k the top state after k passes (the hidden
    output of a k-pass forward, no jitter in eval): the convergence diagnostic the logs print."""
    torch.manual_seed(0)
    model = build_model(tiny_model_config(), feedback()).eval()
    ids, _, doc_start = make_inputs(seq=SEQ)
    with torch.no_grad():
        tops = [model(ids, doc_start=doc_start, num_passes=k).hidden for k in (1, 2, 3)]
        residuals = model(ids, doc_start=doc_start, num_passes=3).pass_residuals
    expected = [(tops[k + 1] - tops[k]).norm() / tops[k].norm() for k in (0, 1)]
    assert len(residuals) == 2 and expected[0] > 1e-3
    for got, want in zip(residuals, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_loss_on_mean_averages_each_passs_loss_in_training_only(single_process):
    """``loss_on: mean``: in training a K-pass forward's token loss is the mean over k = 1..K of the loss
    after k passes (each the token loss of a k-pass forward of the same model, ``loss_on: last``), per
    token. In eval mode it is the last pass's, as under ``loss_on: last``: a K-pass read-out's loss."""
    torch.manual_seed(0)
    state = build_model(tiny_model_config(), feedback()).state_dict()
    models = {}
    for loss_on in ("last", "mean"):
        torch.manual_seed(0)
        models[loss_on] = build_model(tiny_model_config(), feedback(loss_on=loss_on, grad_mode="all", jitter_std=0.0))
        models[loss_on].load_state_dict(state)
    ids, labels, doc_start = make_inputs(seq=SEQ)
    with torch.no_grad():
        per_pass = [models["last"](ids, doc_start=doc_start, labels=labels, num_passes=k).token_loss for k in (1, 2, 3)]
        mean = models["mean"](ids, doc_start=doc_start, labels=labels, num_passes=3).token_loss
        evaluated = models["mean"].eval()(ids, doc_start=doc_start, labels=labels, num_passes=3).token_loss
    assert mean.shape == per_pass[0].shape == labels.shape
    torch.testing.assert_close(mean, sum(per_pass) / 3, rtol=1e-5, atol=1e-6)
    assert (per_pass[2] - per_pass[0]).abs().max() > 1e-3  # the passes differ: the mean is not any one of them
    torch.testing.assert_close(evaluated, per_pass[2], rtol=1e-5, atol=1e-6)
