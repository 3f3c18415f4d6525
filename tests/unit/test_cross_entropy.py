"""The loss's row maximum by torch.amax (fbt_megatron/model/cross_entropy.py).

The reference is cross entropy's definition (log-sum-exp minus the target's logit; gradient softmax minus
the one-hot target), then Megatron-Core's own ``calculate_logits_max``: with the replacement the loss and
the gradient of Megatron's vocabulary-parallel cross entropy are bitwise what Megatron's gives, with tied
maxima and the -inf padding columns the model puts on a padded vocabulary; the model built installs it.
Over one CPU rank the loss runs Megatron's steps without its three all-reduces: bitwise Megatron's
function, no all-reduce called; label smoothing, a group of two and other devices are Megatron's."""

import inspect

import megatron.core
import pytest
import torch
from megatron.core import parallel_state
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

from fbt_megatron.model import cross_entropy
from fbt_megatron.model.fbt_gpt import build_model
from model_helpers import LLAMA, feedback, loss_and_grads, tiny_model_config


def logits_and_labels(seed=0, s=16, b=3, v=40):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(s, b, v, generator=g) * 4.0
    logits[0, 0, 3] = logits[0, 0, 7] = logits[0, 0].max() + 1.0  # a tied maximum
    logits[..., -5:] = float("-inf")  # padding columns of a padded vocabulary
    labels = torch.randint(0, v - 5, (s, b), generator=g)
    return logits, labels


def loss_and_grad(logits, labels, logits_max):
    saved = VocabParallelCrossEntropy.calculate_logits_max
    VocabParallelCrossEntropy.calculate_logits_max = staticmethod(logits_max)
    try:
        x = logits.clone().requires_grad_(True)
        loss = cross_entropy.MEGATRON_CROSS_ENTROPY(x, labels)  # Megatron's own, whatever is installed
        loss.backward(torch.linspace(0.5, 1.5, loss.numel()).view_as(loss))
        return loss.detach(), x.grad
    finally:
        VocabParallelCrossEntropy.calculate_logits_max = saved


def assert_is_the_definition(logits, labels, loss, grad):
    """Cross entropy written out in float64: log-sum-exp minus the target's logit; its gradient under
    the backward's weights (``loss_and_grad``'s linspace) softmax minus the one-hot target."""
    x = logits.double()
    target = x.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(loss.double(), torch.logsumexp(x, -1) - target, rtol=1e-6, atol=1e-6)
    weight = torch.linspace(0.5, 1.5, labels.numel()).view_as(labels).double().unsqueeze(-1)
    expected = (torch.softmax(x, -1) - torch.nn.functional.one_hot(labels, x.shape[-1]).double()) * weight
    assert torch.allclose(grad.double(), expected, atol=1e-6)


def test_bitwise_megatron_and_the_definition(single_process):
    logits, labels = logits_and_labels()
    ours = loss_and_grad(logits, labels, cross_entropy.calculate_logits_max)
    theirs = loss_and_grad(logits, labels, cross_entropy.MEGATRON_LOGITS_MAX)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert_is_the_definition(logits, labels, *ours)


def test_bf16_logits_bitwise_megatron(single_process):
    """bf16 logits (a bf16 run's output layer): both cast to float32 before the maximum."""
    logits, labels = logits_and_labels(seed=1)
    logits = logits.bfloat16()
    ours = loss_and_grad(logits, labels, cross_entropy.calculate_logits_max)
    theirs = loss_and_grad(logits, labels, cross_entropy.MEGATRON_LOGITS_MAX)
    assert ours[0].dtype == torch.float32 and ours[1].dtype == torch.bfloat16
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_the_model_installs_it(single_process, all_reduces):
    """Building the model installs both; the model's loss (Megatron's language module) then calls no
    all-reduce and is bitwise what Megatron's function gives, gradients included."""
    VocabParallelCrossEntropy.calculate_logits_max = staticmethod(cross_entropy.MEGATRON_LOGITS_MAX)
    tensor_parallel.vocab_parallel_cross_entropy = cross_entropy.MEGATRON_CROSS_ENTROPY
    try:
        model = build_model(tiny_model_config(**LLAMA), feedback())
        assert VocabParallelCrossEntropy.calculate_logits_max is cross_entropy.calculate_logits_max
        assert tensor_parallel.vocab_parallel_cross_entropy is cross_entropy.vocab_parallel_cross_entropy
        ours = loss_and_grads(model, 1)
        assert all_reduces == []
        tensor_parallel.vocab_parallel_cross_entropy = cross_entropy.MEGATRON_CROSS_ENTROPY
        theirs = loss_and_grads(model, 1)
        assert len(all_reduces) == 3
    finally:
        cross_entropy.install()
    assert torch.equal(ours[0], theirs[0]) and ours[1].keys() == theirs[1].keys()
    for name in ours[1]:
        assert torch.equal(ours[1][name], theirs[1][name]), name


def one_rank_loss_and_grad(function, logits, labels, label_smoothing=0.0):
    x = logits.clone().requires_grad_(True)
    loss = function(x, labels, label_smoothing)
    loss.backward(torch.linspace(0.5, 1.5, loss.numel()).view_as(loss))
    return loss.detach(), x.grad


@pytest.fixture
def all_reduces(monkeypatch):
    """The all-reduces called (torch.distributed's, where Megatron's loss calls it)."""
    calls = []
    real = torch.distributed.all_reduce
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_rank_is_megatrons_function_without_its_all_reduces(single_process, all_reduces, dtype):
    cross_entropy.install()
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(16, 3, 40, generator=g) * 4.0).to(dtype)
    labels = torch.randint(0, 40, (16, 3), generator=g)
    labels[0, 0], labels[1, 0] = 39, 0  # the vocabulary's two ends
    theirs = one_rank_loss_and_grad(cross_entropy.MEGATRON_CROSS_ENTROPY, logits, labels)
    assert len(all_reduces) == 3  # the maximum, the target's logit, the sum of exponentials
    ours = one_rank_loss_and_grad(cross_entropy.vocab_parallel_cross_entropy, logits, labels)
    assert len(all_reduces) == 3
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    if dtype == torch.float32:
        assert_is_the_definition(logits, labels, *ours)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_rank_labels_outside_the_vocabulary_and_padding(single_process, dtype):
    """Megatron masks a label outside this rank's range (its target logit counts 0); tied maxima and -inf
    padding columns, and a label on one: the same loss and gradient, bitwise, and the same softmax left
    in the caller's float32 logits (both work in place)."""
    cross_entropy.install()
    logits, labels = logits_and_labels(seed=3)
    logits = logits.to(dtype)
    labels[0, 0], labels[0, 1], labels[1, 2] = -100, 40, 37  # before, past the end, a -inf column
    theirs = one_rank_loss_and_grad(cross_entropy.MEGATRON_CROSS_ENTROPY, logits, labels)
    ours = one_rank_loss_and_grad(cross_entropy.vocab_parallel_cross_entropy, logits, labels)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    if dtype == torch.float32:
        a, b = logits.clone(), logits.clone()
        cross_entropy.MEGATRON_CROSS_ENTROPY(a, labels)
        cross_entropy.vocab_parallel_cross_entropy(b, labels)
        assert torch.equal(a, b) and not torch.equal(a, logits)


@pytest.mark.parametrize("case", ["label_smoothing", "two_ranks", "meta"])
def test_everything_else_is_megatrons_loss(single_process, monkeypatch, case):
    calls = []
    monkeypatch.setattr(cross_entropy, "MEGATRON_CROSS_ENTROPY", lambda *args: calls.append(args) or "megatron")
    if case == "two_ranks":
        monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 2)
    logits, labels = logits_and_labels()
    if case == "meta":
        logits, labels = logits.to("meta"), labels.to("meta")
    smoothing = 0.1 if case == "label_smoothing" else 0.0
    assert cross_entropy.vocab_parallel_cross_entropy(logits, labels, smoothing) == "megatron"
    assert len(calls) == 1 and calls[0][0] is logits and calls[0][2] == smoothing


def test_written_for_this_megatron_core():
    """The replacement takes Megatron's place by name: an upgrade that changes the function must be checked
    again (pyproject pins megatron-core 0.16.x)."""
    assert megatron.core.__version__.startswith("0.16."), megatron.core.__version__
    assert "torch.max(vocab_parallel_logits, dim=-1)[0]" in inspect.getsource(cross_entropy.MEGATRON_LOGITS_MAX)
    assert list(inspect.signature(cross_entropy.MEGATRON_LOGITS_MAX).parameters) == ["vocab_parallel_logits"]
