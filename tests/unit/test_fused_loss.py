"""The loss on GPU is a fused cross entropy: Transformer Engine's where installed (no fp32 [S, B, V] copy of
the logits per kept head), Megatron's fused one in bf16 without it; the CPU keeps its unfused loss. Loss and
logits' gradient are checked against the formula: logsumexp(x) - x[y] and softmax(x) - onehot(y)."""

import pytest
import torch

from fbt_megatron.model.kernels import cross_entropy_switches, fused_switches


def test_which_loss_runs_where():
    te = lambda name: name == "transformer_engine.pytorch.cross_entropy"  # noqa: E731
    none = lambda name: False  # noqa: E731
    assert cross_entropy_switches(True, True, te) == {"cross_entropy_loss_fusion": True,
                                                     "cross_entropy_fusion_impl": "te"}
    assert cross_entropy_switches(True, False, te)["cross_entropy_fusion_impl"] == "te"  # TE's runs in fp32 too
    assert cross_entropy_switches(True, True, none) == {"cross_entropy_loss_fusion": True,
                                                       "cross_entropy_fusion_impl": "native"}
    assert cross_entropy_switches(True, False, none) == {}  # Megatron's fused one returns bf16 gradients
    assert cross_entropy_switches(False, True, te) == {}
    assert fused_switches("RMSNorm", on_gpu=True, available=te)["cross_entropy_fusion_impl"] == "te"
    assert "cross_entropy_loss_fusion" not in fused_switches("RMSNorm", on_gpu=False, available=te)


def formula(logits: torch.Tensor, labels: torch.Tensor):
    x = logits.double()
    loss = torch.logsumexp(x, -1) - x.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    grad = torch.softmax(x, -1) - torch.nn.functional.one_hot(labels, x.shape[-1]).double()
    return loss, grad


def test_megatrons_fused_loss_equals_the_formula(single_process):
    """bf16 logits [S, B, V] with two padded columns at -inf (as the model's head leaves them): loss and
    gradient of the sum of the losses within bf16 rounding of the formula's."""
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 2, 16, generator=g) * 3
    logits[..., 14:] = float("-inf")
    labels = torch.randint(0, 14, (5, 2), generator=g)
    x = logits.to(torch.bfloat16).requires_grad_()
    loss = fused_vocab_parallel_cross_entropy(x, labels, parallel_state.get_tensor_model_parallel_group())
    loss.sum().backward()
    want_loss, want_grad = formula(x.detach(), labels)
    torch.testing.assert_close(loss.double(), want_loss, rtol=0, atol=2e-2)
    torch.testing.assert_close(x.grad.double(), want_grad, rtol=0, atol=1e-2)
    assert x.grad[..., 14:].abs().max() == 0  # padding takes no probability


@pytest.mark.gpu
def test_gpu_te_loss_equals_the_formula(cuda_device, single_process):
    from megatron.core import parallel_state
    from megatron.core.extensions.transformer_engine import te_parallel_cross_entropy

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 2, 16, generator=g) * 3)
    logits[..., 14:] = float("-inf")
    labels = torch.randint(0, 14, (5, 2), generator=g)
    x = logits.to(cuda_device, torch.bfloat16).requires_grad_()
    want_loss, want_grad = formula(x.detach().cpu(), labels)
    loss = te_parallel_cross_entropy(x, labels.to(cuda_device), parallel_state.get_tensor_model_parallel_group())
    loss.sum().backward()
    torch.testing.assert_close(loss.double().cpu(), want_loss, rtol=0, atol=2e-2)
    torch.testing.assert_close(x.grad.double().cpu(), want_grad, rtol=0, atol=1e-2)
