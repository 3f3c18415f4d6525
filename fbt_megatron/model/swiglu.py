"""SwiGLU on CPU in one autograd node: Megatron's fused-SwiGLU switch, without a compiler.

Megatron-Core's MLP has two SwiGLU paths. Unfused (``bias_activation_fusion=False``), it computes
``silu(x_1) * (x_2 + glu_linear_offset)``: a full extra pass and a saved ``[S, B, F]`` tensor for an
offset that is 0.0 here, and in backward autograd's gradient of the ``chunk`` is a ``torch.cat`` of the
two halves' gradients, another ``[S, B, 2F]`` copy. Fused, it calls ``bias_swiglu_impl``, whose kernels
are ``torch.compile``d (Megatron's ``jit_fuser``): right on GPU, but on CPU that means a C++ compiler
and a compile in every process at the first step. :func:`bias_swiglu_impl` here takes the fused call on
CPU with plain torch operators: ``silu(x_1) * x_2`` forward (the tensors autograd would save: ``x_1``,
``x_2`` and ``silu(x_1)``), and a backward that writes both halves' gradients into one buffer, the same
operators autograd runs, so values and gradients are bitwise the unfused path's except the sign of a
zero where ``x_2`` is -0.0 (``-0.0 + 0.0`` is +0.0) (``tests/test_swiglu.py``). On GPU it hands the call
to Megatron's compiled function unchanged. Only the dense MLP's call is replaced: MoE experts and
``weighted_bias_swiglu_impl`` (per-token scales) would still compile on CPU.

:func:`install` puts it where Megatron's MLP looks the function up (``megatron.core.transformer.mlp``);
the model calls it when it is built on the CPU path only (``fbt_gpt.install_cpu_replacements``), and ``model/kernels.py`` turns the switch on for SwiGLU everywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer import mlp as megatron_mlp

MEGATRON_BIAS_SWIGLU = megatron_mlp.bias_swiglu_impl  # the compiled kernels: every non-CPU tensor


class SwiGLU(torch.autograd.Function):
    """``silu(x_1) * x_2`` for ``x = [x_1, x_2]`` split in half along the last dimension."""

    @staticmethod
    def forward(ctx, x):
        x_1, x_2 = torch.chunk(x, 2, dim=-1)
        activated = F.silu(x_1)
        ctx.save_for_backward(x_1, x_2, activated)
        return activated * x_2

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x_1, x_2, activated = ctx.saved_tensors
        half = x_1.shape[-1]
        grad_x = torch.empty(grad.shape[:-1] + (half + x_2.shape[-1],), dtype=grad.dtype, device=grad.device)
        # d/dx_1 = silu'(x_1) * (grad * x_2), d/dx_2 = grad * silu(x_1): autograd's operators, in place of
        # its two tensors and their concatenation.
        torch.ops.aten.silu_backward.grad_input(grad * x_2, x_1, grad_input=grad_x[..., :half])
        torch.mul(grad, activated, out=grad_x[..., half:])
        return grad_x


def bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
    """Megatron's ``bias_swiglu_impl`` (same arguments and results); CPU tensors go through :class:`SwiGLU`."""
    if input.device.type != "cpu":
        return MEGATRON_BIAS_SWIGLU(input, bias, fp8_input_store, cpu_offload_input)
    if fp8_input_store:
        raise ValueError("activation_func_fp8_input_store keeps SwiGLU's input in FP8, a GPU-only option")
    return SwiGLU.apply(input if bias is None else input + bias)


def install() -> None:
    """Make Megatron's MLP use :func:`bias_swiglu_impl` (idempotent)."""
    megatron_mlp.bias_swiglu_impl = bias_swiglu_impl
