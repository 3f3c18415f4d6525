"""The model head's loss, and its ``one_rank_loss`` CPU fast path (fbt_megatron/model/cpu_fastpaths.py).

The head calls the loss itself: Megatron's ``tensor_parallel.vocab_parallel_cross_entropy`` as Megatron ships
it (no replaced global), or over a one-rank CPU group the room's fast path: Megatron's own steps without
the three all-reduces over one rank, the row maximum by ``torch.amax``. The reference is cross entropy's
definition (log-sum-exp minus the target's logit; gradient softmax minus the one-hot target), then
Megatron's function: loss and gradient bitwise, with tied maxima, the -inf padding columns of a padded
vocabulary and labels outside the vocabulary; a group of two, other devices and the room switched off
are Megatron's."""

import pytest
import torch
from megatron.core import parallel_state, tensor_parallel

from fbt_megatron.model import cpu_fastpaths as room
from fbt_megatron.model.fbt_gpt import build_model
from tests.support.model_helpers import LLAMA, feedback, loss_and_grads, tiny_model_config

MEGATRON_CROSS_ENTROPY = tensor_parallel.vocab_parallel_cross_entropy


def logits_and_labels(seed=0, s=16, b=3, v=40):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(s, b, v, generator=g) * 4.0
    logits[0, 0, 3] = logits[0, 0, 7] = logits[0, 0].max() + 1.0  # a tied maximum
    logits[..., -5:] = float("-inf")  # padding columns of a padded vocabulary
    labels = torch.randint(0, v - 5, (s, b), generator=g)
    return logits, labels


def assert_is_the_definition(logits, labels, loss, grad):
    """Cross entropy written out in float64: log-sum-exp minus the target's logit; its gradient under
    the backward's weights (``loss_and_grad``'s linspace) softmax minus the one-hot target."""
    x = logits.double()
    target = x.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(loss.double(), torch.logsumexp(x, -1) - target, rtol=1e-6, atol=1e-6)
    weight = torch.linspace(0.5, 1.5, labels.numel()).view_as(labels).double().unsqueeze(-1)
    expected = (torch.softmax(x, -1) - torch.nn.functional.one_hot(labels, x.shape[-1]).double()) * weight
    assert torch.allclose(grad.double(), expected, atol=1e-6)


def loss_and_grad(function, logits, labels):
    x = logits.clone().requires_grad_(True)
    loss = function(x, labels)
    loss.backward(torch.linspace(0.5, 1.5, loss.numel()).view_as(loss))
    return loss.detach(), x.grad


@pytest.fixture
def all_reduces(monkeypatch):
    """The all-reduces called (torch.distributed's, where Megatron's loss calls it)."""
    calls = []
    real = torch.distributed.all_reduce
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


@pytest.fixture
def installed(single_process):
    room.install("cpu")
    yield
    room.install("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_rank_is_megatrons_function_without_its_all_reduces(installed, all_reduces, dtype):
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(16, 3, 40, generator=g) * 4.0).to(dtype)
    labels = torch.randint(0, 40, (16, 3), generator=g)
    labels[0, 0], labels[1, 0] = 39, 0  # the vocabulary's two ends
    theirs = loss_and_grad(MEGATRON_CROSS_ENTROPY, logits, labels)
    assert len(all_reduces) == 3  # the maximum, the target's logit, the sum of exponentials
    ours = loss_and_grad(room.one_rank_cross_entropy, logits, labels)
    assert len(all_reduces) == 3
    assert ours[0].dtype == torch.float32 and ours[1].dtype == dtype
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    if dtype == torch.float32:
        assert_is_the_definition(logits, labels, *ours)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_rank_labels_outside_the_vocabulary_and_padding(installed, dtype):
    """Megatron masks a label outside this rank's range (its target logit counts 0); tied maxima and -inf
    padding columns, and a label on one: the same loss and gradient, bitwise, and the same softmax left
    in the caller's float32 logits (both work in place)."""
    logits, labels = logits_and_labels(seed=3)
    logits = logits.to(dtype)
    labels[0, 0], labels[0, 1], labels[1, 2] = -100, 40, 37  # before, past the end, a -inf column
    theirs = loss_and_grad(MEGATRON_CROSS_ENTROPY, logits, labels)
    ours = loss_and_grad(room.one_rank_cross_entropy, logits, labels)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    if dtype == torch.float32:
        a, b = logits.clone(), logits.clone()
        MEGATRON_CROSS_ENTROPY(a, labels)
        room.one_rank_cross_entropy(b, labels)
        assert torch.equal(a, b) and not torch.equal(a, logits)
    else:
        assert_is_the_definition(*logits_and_labels(seed=3), *loss_and_grad(room.one_rank_cross_entropy,
                                                                             *logits_and_labels(seed=3)))


@pytest.mark.parametrize("case", ["two_ranks", "meta", "switched_off"])
def test_everything_else_is_megatrons_loss(installed, monkeypatch, case):
    logits, labels = logits_and_labels()
    if case == "two_ranks":
        monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 2)
    elif case == "meta":
        logits, labels = logits.to("meta"), labels.to("meta")
    else:
        room.uninstall(["one_rank_loss"])
    assert room.one_rank_cross_entropy(logits, labels) is None


def test_the_head_calls_the_loss_itself(installed, all_reduces):
    """The model's head: with the room, no all-reduce and bitwise what Megatron's function gives (loss and
    every gradient); without it, Megatron's function, found at Megatron's own name, not replaced."""
    assert tensor_parallel.vocab_parallel_cross_entropy is MEGATRON_CROSS_ENTROPY
    model = build_model(tiny_model_config(**LLAMA), feedback())
    ours = loss_and_grads(model, 1)
    assert all_reduces == []
    with room.disabled(["one_rank_loss"]):
        theirs = loss_and_grads(model, 1)
    assert len(all_reduces) == 3
    assert torch.equal(ours[0], theirs[0]) and ours[1].keys() == theirs[1].keys()
    for name in ours[1]:
        assert torch.equal(ours[1][name], theirs[1][name]), name


def test_the_head_equals_megatrons_language_model_loss(installed):
    """With the room off, the head's loss is Megatron's ``compute_language_model_loss`` on the same logits."""
    model = build_model(tiny_model_config(), feedback())
    top = torch.randn(16, 2, model.config.hidden_size)
    labels = torch.randint(0, model.model_config.vocab_size, (2, 16))
    logits, _ = model.gpt.output_layer(top, weight=model.gpt.shared_embedding_or_output_weight())
    with room.disabled():
        ours = model.language_model_loss(labels, logits.clone())
    assert torch.equal(ours, model.gpt.compute_language_model_loss(labels, logits.clone()))
    assert ours.shape == (2, 16)
