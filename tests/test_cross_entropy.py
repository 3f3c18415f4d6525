"""The loss's row maximum by torch.amax (fbt_megatron/model/cross_entropy.py).

The reference is cross entropy's definition (log-sum-exp minus the target's logit; gradient softmax minus
the one-hot target), then Megatron-Core's own ``calculate_logits_max``: with the replacement the loss and
the gradient of Megatron's vocabulary-parallel cross entropy are bitwise what Megatron's gives, with tied
maxima and the -inf padding columns the model puts on a padded vocabulary; the model built installs it."""

import inspect

import megatron.core
import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

from fbt_megatron.model import cross_entropy
from fbt_megatron.model.fbt_gpt import build_model
from model_helpers import LLAMA, feedback, tiny_model_config


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
        loss = tensor_parallel.vocab_parallel_cross_entropy(x, labels)
        loss.backward(torch.linspace(0.5, 1.5, loss.numel()).view_as(loss))
        return loss.detach(), x.grad
    finally:
        VocabParallelCrossEntropy.calculate_logits_max = saved


def test_bitwise_megatron_and_the_definition(single_process):
    logits, labels = logits_and_labels()
    ours = loss_and_grad(logits, labels, cross_entropy.calculate_logits_max)
    theirs = loss_and_grad(logits, labels, cross_entropy.MEGATRON_LOGITS_MAX)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    # the definition, in float64
    x = logits.double()
    target = x.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(ours[0].double(), torch.logsumexp(x, -1) - target, rtol=1e-6, atol=1e-6)
    weight = torch.linspace(0.5, 1.5, labels.numel()).view_as(labels).double().unsqueeze(-1)
    grad = (torch.softmax(x, -1) - torch.nn.functional.one_hot(labels, x.shape[-1]).double()) * weight
    assert torch.allclose(ours[1].double(), grad, atol=1e-6)


def test_bf16_logits_bitwise_megatron(single_process):
    """bf16 logits (a bf16 run's output layer): both cast to float32 before the maximum."""
    logits, labels = logits_and_labels(seed=1)
    logits = logits.bfloat16()
    ours = loss_and_grad(logits, labels, cross_entropy.calculate_logits_max)
    theirs = loss_and_grad(logits, labels, cross_entropy.MEGATRON_LOGITS_MAX)
    assert ours[0].dtype == torch.float32 and ours[1].dtype == torch.bfloat16
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_the_model_installs_it(single_process):
    VocabParallelCrossEntropy.calculate_logits_max = staticmethod(cross_entropy.MEGATRON_LOGITS_MAX)
    try:
        build_model(tiny_model_config(**LLAMA), feedback())
        assert VocabParallelCrossEntropy.calculate_logits_max is cross_entropy.calculate_logits_max
    finally:
        cross_entropy.install()


def test_written_for_this_megatron_core():
    """The replacement takes Megatron's place by name: an upgrade that changes the function must be checked
    again (pyproject pins megatron-core 0.16.x)."""
    assert megatron.core.__version__.startswith("0.16."), megatron.core.__version__
    assert "torch.max(vocab_parallel_logits, dim=-1)[0]" in inspect.getsource(cross_entropy.MEGATRON_LOGITS_MAX)
    assert list(inspect.signature(cross_entropy.MEGATRON_LOGITS_MAX).parameters) == ["vocab_parallel_logits"]
