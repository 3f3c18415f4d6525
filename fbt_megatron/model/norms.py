"""The torch norms of Megatron's local layers (no apex or Transformer Engine): usable under sequence
parallelism, and RMSNorm's backward in a few passes on CPU.

Megatron's ``WrappedTorchNorm`` returns ``torch.nn.LayerNorm``/``RMSNorm``. It refuses
``sequence_parallel`` because it cannot mark its weights for the gradient all-reduce that sequence
parallelism needs: under SP each TP rank normalises only its chunk of the sequence, so a norm's weight
gradient is partial and must be summed over the TP group. Megatron's apex/TE norms set
``param.sequence_parallel = True`` for that; :class:`TorchNorm` does the same for torch's norms, and
:class:`fbt_megatron.engine.Engine` sums such gradients over TP. The math of the norm is per token, so
nothing else changes.

torch's RMSNorm on CPU is a composite of six elementwise operators, and autograd differentiates each of
them (about a dozen kernels forward and backward): at ``[128, 8, 768]`` its forward and backward take
~4 ms where :class:`RMSNormFunction` takes ~1 ms, and a 100M model runs 58 of them per step. The forward is
torch's own operators (bitwise its values); the backward is the closed form, close to autograd's to
rounding. GPU tensors, other dtypes and norms without a weight go to torch unchanged.
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.torch_norm import WrappedTorchNorm


class RMSNormFunction(torch.autograd.Function):
    """``y = x · r · w`` with ``r = (mean(x²) + eps)^-1/2`` over the last dimension (size ``h``).

    Backward, for an upstream gradient ``g``: ``dw = Σ_rows g·x·r`` and
    ``dx = g·w·r - x · r³ · Σ_j(g·w·x)_j / h``. The two row and column sums are matrix-vector products of
    ``g·x``, so the backward is four elementwise passes and two ``mv``s; ``x`` (kept alive by the
    residual stream anyway) and ``r`` (one value per token) are what it saves."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        # torch's rms_norm operators in its order: the same values
        rstd = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
        ctx.save_for_backward(x, weight, rstd)
        return torch.mul(x, rstd).mul_(weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        h = x.shape[-1]
        x2, g2, r = x.reshape(-1, h), grad.reshape(-1, h), rstd.reshape(-1, 1)
        gx = torch.mul(g2, x2)
        grad_weight = torch.mv(gx.t(), r.view(-1)) if ctx.needs_input_grad[1] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            coef = torch.mv(gx, weight).unsqueeze(-1).mul_(r.pow(3)).div_(-h)  # -r³ Σ_j g w x / h, per row
            grad_x = torch.mul(g2, weight).mul_(r).addcmul_(x2, coef).view(x.shape)
        return grad_x, grad_weight, None


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (same parameters, state dict and GPU path) whose CPU forward and backward
    for float32/float64 with a weight are :class:`RMSNormFunction`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or self.weight is None
                or len(self.normalized_shape) != 1 or self.weight.dtype != x.dtype):
            return super().forward(x)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps  # torch's default when unset
        return RMSNormFunction.apply(x, self.weight, eps)


class TorchNorm:
    """Megatron's norm constructor for its local layers; returns a ``torch.nn.LayerNorm`` or
    :class:`RMSNorm` in ``params_dtype`` (as apex's and TE's norms are; ``WrappedTorchNorm`` left them in
    the default dtype) whose weights carry ``sequence_parallel`` as the config says."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        # WrappedTorchNorm's refusals, except sequence parallelism (handled here): a torch norm has none
        # of these kernels, and ignoring zero-centred gamma would be the wrong formula
        for option in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
            if getattr(config, option, False):
                raise ValueError(f"{option} needs apex's or Transformer Engine's norm; the torch norm of "
                                 "Megatron's local layers has none")
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"model.normalization={config.normalization!r}: allowed LayerNorm, RMSNorm")
        norm.to(dtype=config.params_dtype)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def is_torch_norm(module) -> bool:
    return module is WrappedTorchNorm
