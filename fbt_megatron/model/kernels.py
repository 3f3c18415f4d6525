"""Megatron's fused-kernel switches, turned on only where the kernels exist.

``TransformerConfig`` asks for fusions by flag, and Megatron asserts or fails at run time when a flag
names a kernel that is not installed (``persist_layer_norm`` with the torch norm is an assertion in
``WrappedTorchNorm``, and a ``ValueError`` in ``norms.TorchNorm`` that replaces it). Which kernel each
switch needs:

- ``bias_dropout_fusion``: Megatron's own ``jit_fuser`` (torch), any GPU.
- ``bias_activation_fusion``: only for SwiGLU (``bias_swiglu``: exact SiLU) on GPU, Megatron's
  ``jit_fuser`` (``torch.compile``d) kernel; on CPU that would need a C++ compiler and a compile in every
  process, so the CPU runs Megatron's unfused SwiGLU. Megatron's fused GELU
  (``bias_gelu``/``bias_geglu``) is the tanh approximation, while the CPU path, the HF export and
  generation compute exact (erf) GELU — a GELU model trains with exact GELU on GPU too, so what the
  GPU trains is what ``model.activation: gelu`` says and the export computes;
- ``masked_softmax_fusion``: apex's ``scaled_masked_softmax_cuda`` kernels (local attention spec);
- ``persist_layer_norm``: apex's ``FastLayerNormFN``, used by Megatron's ``FusedLayerNorm`` (local spec,
  LayerNorm only; RMSNorm is a torch norm there);
- ``gradient_accumulation_fusion``: writes into Megatron DDP's ``param.main_grad``, which DeepSpeed does
  not provide: always off here (DeepSpeed accumulates in fp32 itself, see ``engine/engine.py``);
- ``cross_entropy_loss_fusion`` (GPU): with Transformer Engine its Triton cross entropy
  (``cross_entropy_fusion_impl: te``), which writes the logits' gradient over the bf16 logits instead of
  holding an fp32 [S, B, V] softmax per kept head; without TE, in bf16, Megatron's fused one (``native``:
  fewer kernels, the same fp32 softmax, its gradient returned in bf16, hence bf16 only). Off on CPU,
  where the loss is ``tensor_parallel.vocab_parallel_cross_entropy`` (or the room's one-rank loss);
- ``apply_rope_fusion``: off here; TE's fused bshd RoPE takes one position table for the whole batch, and
  the dense paths need per-document positions. The model turns it on exactly when attention runs packed
  on TE (``FBTGPTModel``): TE's fused THD RoPE restarts positions at every packed sequence.
"""

from __future__ import annotations

import importlib.util


def module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package missing or broken
        return False


def fused_switches(normalization: str, on_gpu: bool, available=module_available, activation: str = "gelu",
                   bf16: bool = True) -> dict:
    apex_softmax = all(available(m) for m in ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"))
    apex_persist_norm = available("apex.contrib.layer_norm.layer_norm") and available("apex.normalization")
    return dict(
        **cross_entropy_switches(on_gpu, bf16, available),
        gradient_accumulation_fusion=False,
        bias_activation_fusion=on_gpu and activation == "swiglu",
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=on_gpu and apex_softmax,
        persist_layer_norm=on_gpu and apex_persist_norm and normalization == "LayerNorm",
        apply_rope_fusion=False,
    )


def cross_entropy_switches(on_gpu: bool, bf16: bool, available=module_available) -> dict:
    """The loss's fusion (module doc): TE's cross entropy where TE is installed, Megatron's fused one in bf16
    without it, none on CPU (an empty dict leaves Megatron's defaults: off)."""
    if not on_gpu:
        return {}
    if available("transformer_engine.pytorch.cross_entropy"):
        return dict(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te")
    if bf16:
        return dict(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native")
    return {}
