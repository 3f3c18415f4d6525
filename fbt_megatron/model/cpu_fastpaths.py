"""The CPU fast paths: the one module that replaces a Megatron-Core or DeepSpeed function for speed.

Contract. :func:`install` (called where the model is built, with the model's device) installs the
shortcuts below only when the device is the CPU, ``FBT_CPU_FASTPATHS`` is not ``"0"`` and the installed
megatron-core, deepspeed and torch are the versions in :data:`CHECKED_VERSIONS` (on a mismatch it warns
once, naming both, and installs nothing: the stock path is always correct). Every other device runs Megatron's,
Transformer Engine's and DeepSpeed's own functions with no replaced global. Each shortcut gives the
library's values and gradients bitwise (``tests/unit/test_cpu_fastpath*.py``, ``tests/unit/test_engine_step.py``)
and takes the short way only in the case it was written for (CPU tensors, one tensor-parallel or data-parallel
rank), handing every other call to the
library's own function, with its arguments passed through by name. :func:`uninstall` (or :func:`disabled`)
puts the libraries' own objects back.

Why: speed on the 2-core CPU machine where the research runs train. A shortcut stays here only while it
gains >= 2 % of a training step at a research size, measured side by side by
``benchmarks/bench_cpu_fastpaths.py``, or, for the ZeRO ones, whose gain is the fresh memory a training
process faults in every step (which one process alternating variants does not see), by
``benchmarks/bench_train.py``'s process per variant (figures, and the shortcuts deleted by that rule, in
``docs/results/benchmarks.md``). The shortcuts, by name:

- ``rope``: Megatron's unfused RoPE with cos/sin once per frequency tensor (not twice per layer and pass)
  and the rotation written half by half into one tensor (no negated copy, concatenation or final copy).
- ``one_rank_loss``: the model head's cross entropy over a one-rank tensor-parallel group (Megatron's own
  steps, its static methods in its order, without the three all-reduces over one rank, each a gloo call,
  and the row maximum by ``torch.amax``, which does not compute the argmax ``torch.max`` throws away).
- ``one_rank_linear``: Megatron's tensor-parallel linear layers and region mappings over a one-rank group
  as a plain ``matmul`` and the tensor itself (Megatron's Python autograd nodes are identities there).
- ``zero_one_rank_reduce``: ZeRO-1/2's gradient-bucket reduction over a one-rank data-parallel group
  without the flatten, the division by 1 and the all-reduce over one rank.
- ``zero_kept_grad_partition``: ZeRO-1/2's flat fp32 gradient partition written into a buffer kept
  between steps instead of a fresh allocation the kernel faults in page by page every step.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from importlib.metadata import PackageNotFoundError, version

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import layers as megatron_layers
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from megatron.core.transformer import attention as megatron_attention

from fbt_megatron.model.tensor_memo import LastTensorMemo

ENV = "FBT_CPU_FASTPATHS"  # "0": the stock path on CPU too

# The library versions every shortcut below was checked against (their internals: argument names, call
# sites, the steps they repeat), by their equality tests run at both corners CI tests (docs/install.md).
# Any other version runs the stock path until re-checked and added here.
CHECKED_VERSIONS = {"megatron-core": ("0.16.1", "0.19.2"), "deepspeed": ("0.19.8",), "torch": ("2.11.0", "2.13.0")}

# The libraries' own objects at the lookup points the shortcuts replace, read at import (before any install).
MEGATRON_APPLY_ROPE = megatron_attention.apply_rotary_pos_emb
MEGATRON_LINEAR = megatron_layers.linear_with_grad_accumulation_and_async_allreduce
MEGATRON_COPY_TO = megatron_layers.copy_to_tensor_model_parallel_region
MEGATRON_REDUCE_FROM = megatron_layers.reduce_from_tensor_model_parallel_region


def _base_version(package: str) -> str | None:
    try:
        return version(package).split("+")[0]
    except PackageNotFoundError:
        return None


def version_mismatches() -> dict[str, tuple[str | None, str]]:
    """``{package: (installed, checked)}`` for every package of :data:`CHECKED_VERSIONS` whose installed
    version (without a local ``+cpu``/``+cu130`` suffix) is none of the checked ones (``checked``: them, joined)."""
    found = {name: _base_version(name) for name in CHECKED_VERSIONS}
    return {name: (found[name], " or ".join(checked)) for name, checked in CHECKED_VERSIONS.items()
            if found[name] not in checked}


def one_rank(group) -> bool:
    """Whether the TP group (``None``: Megatron's default TP group) has one rank."""
    if group is not None:
        return group.size() == 1
    return ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() == 1


# ----------------------------------------------------------------------------------------------- rope
def _cos_sin(freqs: torch.Tensor, dtype: torch.dtype):
    return torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)


_COS_SIN = LastTensorMemo(_cos_sin)  # per frequency tensor and dtype (model/tensor_memo.py)


class _Rotate(torch.autograd.Function):
    """``t·cos + rotate_half(t)·sin`` with ``rotate_half(t) = [-t_2, t_1]``, half by half into one tensor:
    ``out_1 = t_1 c_1 - t_2 s_1``, ``out_2 = t_2 c_2 + t_1 s_2`` (``(-a)·b + c`` and ``c - a·b`` round
    alike: bitwise Megatron's values and gradients)."""

    @staticmethod
    def forward(ctx, t, cos, sin):
        half = t.shape[-1] // 2
        out = torch.mul(t, cos)
        out[..., :half].sub_(torch.mul(t[..., half:], sin[..., :half]))
        out[..., half:].add_(torch.mul(t[..., :half], sin[..., half:]))
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        # d/dt_1 = g_1 c_1 + g_2 s_2, d/dt_2 = g_2 c_2 - g_1 s_1: the transpose of the rotation
        cos, sin = ctx.saved_tensors
        half = grad.shape[-1] // 2
        grad_t = torch.mul(grad, cos)
        grad_t[..., :half].add_(torch.mul(grad[..., half:], sin[..., half:]))
        grad_t[..., half:].sub_(torch.mul(grad[..., :half], sin[..., :half]))
        return grad_t, None, None


def apply_rotary_pos_emb(t, freqs, *args, **kwargs):
    """Megatron's ``apply_rotary_pos_emb`` (its arguments, passed through); the short way for the unfused
    bshd case with the rotation over the whole head. Anything else (fused RoPE, THD ``cu_seqlens``,
    interleaved, MLA, a YaRN ``mscale``, partial rotary, frequencies with grad) is Megatron's function."""
    config = kwargs.get("config")
    if (args or config is None or set(kwargs) - {"config", "cu_seqlens", "mscale", "cp_group"}
            or kwargs.get("cu_seqlens") is not None or kwargs.get("mscale", 1.0) != 1.0
            or config.apply_rope_fusion or config.rotary_interleaved or config.multi_latent_attention
            or freqs.requires_grad or freqs.shape[-1] != t.shape[-1]):
        return MEGATRON_APPLY_ROPE(t, freqs, *args, **kwargs)
    cos, sin = _COS_SIN.get(freqs, t.dtype)
    return _Rotate.apply(t, cos, sin)


# ------------------------------------------------------------------------------------- one-rank loss
class _OneRankCrossEntropy(torch.autograd.Function):
    """Megatron's ``_VocabParallelCrossEntropy`` without label smoothing over one rank: its steps minus the
    all-reduces (the whole vocabulary is this rank's, from 0), the row maximum by ``torch.amax``."""

    @staticmethod
    def forward(ctx, logits, target):
        steps = VocabParallelCrossEntropy
        logits = logits.float()
        logits_max = torch.amax(logits, dim=-1)  # torch.max(logits, -1)[0]'s values, no argmax
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = steps.calculate_predicted_logits(
            logits, target, logits_max, 0, logits.size(-1))
        softmax, loss = steps.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        steps = VocabParallelCrossEntropy
        grad_2d, arange_1d, update, grad_input = steps.prepare_gradient_calculation_operands(softmax, target_mask)
        return steps.calculate_gradients(grad_2d, arange_1d, masked_target_1d, update, grad_input, grad_output), None


def one_rank_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
    """Per-token cross entropy of ``logits`` [S, B, V] against ``target`` [S, B] by the ``one_rank_loss``
    shortcut when it is installed and applies (CPU logits, one-rank TP group); None otherwise: then the
    caller runs Megatron's ``tensor_parallel.vocab_parallel_cross_entropy``."""
    if "one_rank_loss" in _active and logits.device.type == "cpu" and one_rank(None):
        return _OneRankCrossEntropy.apply(logits, target)
    return None


# ----------------------------------------------------------------------------------- one-rank linear
# the keywords Megatron's layers pass (``gtp_remat_size``: megatron-core 0.19's GTP-sharded weight, 1 = none)
_LINEAR_ARGS = {"bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel",
                "grad_output_buffer", "wgrad_deferral_limit", "async_grad_allreduce", "tp_group", "gtp_remat_size"}


def linear_with_grad_accumulation_and_async_allreduce(input, weight, *args, **kwargs):
    """Megatron's function (its arguments, passed through; Megatron's layers pass ``input`` and ``weight``
    first and the rest by name, which is how they are read here); over one CPU rank without
    gradient-accumulation fusion, sequence parallelism or deferred embedding gradients,
    ``input @ weight^T (+ bias)`` under torch's autograd (Megatron's own product, then the bias)."""
    if (not args and kwargs.keys() <= _LINEAR_ARGS and input.device.type == "cpu"
            and not kwargs.get("gradient_accumulation_fusion") and not kwargs.get("allreduce_dgrad")
            and not kwargs.get("sequence_parallel") and kwargs.get("grad_output_buffer") is None
            and kwargs.get("async_grad_allreduce") is None and kwargs.get("gtp_remat_size", 1) == 1
            and one_rank(kwargs.get("tp_group"))):
        output = torch.matmul(input, weight.t())  # not F.linear: ZeRO-3 replaces that process-wide
        bias = kwargs.get("bias")
        return output if bias is None else output + bias
    return MEGATRON_LINEAR(input, weight, *args, **kwargs)


# Megatron's function reads and sets its one-time warning flag through its module's global name, which
# while installed is this function: carry the flag here.
linear_with_grad_accumulation_and_async_allreduce.warned = MEGATRON_LINEAR.warned


def copy_to_tensor_model_parallel_region(input_, *args, **kwargs):
    """Megatron's mapping; over one CPU rank the tensor itself (its backward all-reduce is the identity)."""
    if not args and kwargs.keys() <= {"group"} and input_.device.type == "cpu" and one_rank(kwargs.get("group")):
        return input_
    return MEGATRON_COPY_TO(input_, *args, **kwargs)


def reduce_from_tensor_model_parallel_region(input_, *args, **kwargs):
    """Megatron's mapping; over one CPU rank the tensor itself (an all-reduce over one rank)."""
    if not args and kwargs.keys() <= {"group"} and input_.device.type == "cpu" and one_rank(kwargs.get("group")):
        return input_
    return MEGATRON_REDUCE_FROM(input_, *args, **kwargs)


# ------------------------------------------------------------------------------ ZeRO-1/2 (DeepSpeed)
def _zero_stage_1_and_2():
    """DeepSpeed's ZeRO-1/2 module, imported when a ZeRO shortcut is first needed (not at model import)."""
    from deepspeed.runtime.zero import stage_1_and_2

    return stage_1_and_2


def _one_rank_reduce(zero_optimizer) -> dict | None:
    """ZeRO-1/2's ``allreduce_and_copy`` over a one-rank data-parallel group: each gradient cast to the
    communication dtype (and back) and added to ZeRO's gradient-partition buffer where one is given, as
    DeepSpeed's bucket does; any other group, overlap or sequence parallelism is DeepSpeed's own."""
    from deepspeed import comm as dist

    stage_1_and_2 = _zero_stage_1_and_2()
    original = zero_optimizer.allreduce_and_copy

    def allreduce_and_copy(small_bucket, communication_data_type, *args, **kwargs):
        group = kwargs.get("process_group")
        group = zero_optimizer.dp_process_group if group is None else group
        if (args or not kwargs.keys() <= {"rank", "log", "divide", "process_group", "output_bucket"}
                or dist.get_world_size(group=group) != 1 or zero_optimizer.overlap_comm
                or stage_1_and_2.pg_correctness_test or zero_optimizer.sequence_parallel_size != 1):
            return original(small_bucket, communication_data_type, *args, **kwargs)
        output_bucket = kwargs.get("output_bucket")
        outputs = output_bucket if output_bucket is not None else [None] * len(small_bucket)
        for grad, output in zip(small_bucket, outputs):
            synced = grad.to(communication_data_type)  # divided by a world size of one and summed over one rank
            zero_optimizer._add_to_grad_partition_buffer(output, synced)
            if synced is not grad:
                grad.copy_(synced)

    return {"allreduce_and_copy": allreduce_and_copy}


def _kept_grad_partition(zero_optimizer) -> dict | None:
    """ZeRO-1/2's flatten of ``averaged_gradients[i]`` (the list object itself) into a buffer kept per size;
    every other flatten (parameters at start-up, checkpoint loading, buckets) is DeepSpeed's. The step hands
    the partition to the inner optimiser as ``.grad`` and drops it after that group's update, before the next
    group's flatten, so one buffer per size serves every group. Not with CPU offload."""
    if zero_optimizer.cpu_offload or any(p.device.type != "cpu" for p in zero_optimizer.single_partition_of_fp32_groups):
        return None
    kept: dict[tuple, torch.Tensor] = {}
    original_flatten, original_aligned = zero_optimizer.flatten, zero_optimizer.flatten_dense_tensors_aligned

    def is_grad_partition(tensors) -> bool:
        # one tensor flattens to a view of itself (no copy, no fresh memory): DeepSpeed's
        return len(tensors) > 1 and any(tensors is grads for grads in zero_optimizer.averaged_gradients.values())

    def into_kept(tensors, alignment: int = 1) -> torch.Tensor:
        total = sum(t.numel() for t in tensors)
        size = -(-total // alignment) * alignment  # align_dense_tensors pads with zeros to a multiple
        key = (size, tensors[0].dtype, tensors[0].device)
        if key not in kept:
            kept[key] = torch.empty(size, dtype=tensors[0].dtype, device=tensors[0].device)
        flat = kept[key]
        torch.cat([t.reshape(-1) for t in tensors], out=flat[:total])
        flat[total:].zero_()
        return flat

    def flatten(tensors):
        return into_kept(tensors) if is_grad_partition(tensors) else original_flatten(tensors)

    def flatten_dense_tensors_aligned(tensor_list, alignment, *args, **kwargs):
        if (not args and kwargs.keys() <= {"use_cpu_data", "param_padding"} and not kwargs.get("use_cpu_data")
                and kwargs.get("param_padding") is None and is_grad_partition(tensor_list)):
            return into_kept(tensor_list, alignment)
        return original_aligned(tensor_list, alignment, *args, **kwargs)

    return {"flatten": flatten, "flatten_dense_tensors_aligned": flatten_dense_tensors_aligned}


# ------------------------------------------------------------------------------------------- registry
# Library lookup points: name -> [(module, attribute, the library's own object, ours)]
LOOKUPS = {
    "rope": [(megatron_attention, "apply_rotary_pos_emb", MEGATRON_APPLY_ROPE, apply_rotary_pos_emb)],
    "one_rank_linear": [
        (megatron_layers, "linear_with_grad_accumulation_and_async_allreduce", MEGATRON_LINEAR,
         linear_with_grad_accumulation_and_async_allreduce),
        (megatron_layers, "copy_to_tensor_model_parallel_region", MEGATRON_COPY_TO, copy_to_tensor_model_parallel_region),
        (megatron_layers, "reduce_from_tensor_model_parallel_region", MEGATRON_REDUCE_FROM,
         reduce_from_tensor_model_parallel_region),
    ],
}
# Per ZeRO-1/2 optimiser: name -> function returning the instance attributes to set (None: does not apply)
ZERO_PATCHES = {"zero_one_rank_reduce": _one_rank_reduce, "zero_kept_grad_partition": _kept_grad_partition}
# Read by the model's own code (no library attribute): the loss head
FLAGS = ("one_rank_loss",)
SHORTCUTS = tuple(LOOKUPS) + FLAGS + tuple(ZERO_PATCHES)

_active: set[str] = set()
_zero_optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimiser -> {name: what it held}
_zero_made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimiser -> {name: attributes or None}
_warned = False
_CLASS = object()  # an attribute the instance did not hold (the class's method)


def wanted(device) -> bool:
    """Whether :func:`install` would install on ``device``: the CPU, ``FBT_CPU_FASTPATHS`` not "0"."""
    return torch.device(device).type == "cpu" and os.environ.get(ENV, "1") != "0"


def active(name: str | None = None) -> bool:
    """Whether shortcut ``name`` (any, with None) is installed."""
    return bool(_active) if name is None else name in _active


def install(device, names=SHORTCUTS) -> bool:
    """Install the shortcuts ``names`` (all by default) if ``device`` is the CPU, ``FBT_CPU_FASTPATHS`` is not
    "0" and the versions are :data:`CHECKED_VERSIONS` (on a mismatch a warning, once); otherwise make sure
    none is installed. Returns whether it installed. Idempotent."""
    global _warned
    if not wanted(device):
        uninstall()
        return False
    mismatches = version_mismatches()
    if mismatches:
        uninstall()
        if not _warned:
            _warned = True
            found = ", ".join(f"{name} {have} (checked: {checked})" for name, (have, checked) in mismatches.items())
            warnings.warn(f"CPU fast paths not installed: {found}; the stock Megatron/DeepSpeed path runs. "
                          f"Re-check model/cpu_fastpaths.py against these versions and update CHECKED_VERSIONS.",
                          RuntimeWarning, stacklevel=2)
        return False
    for name in names:
        _set(name, True)
    return True


def uninstall(names=SHORTCUTS) -> None:
    """Put the libraries' own objects back (every lookup point, every patched ZeRO optimiser)."""
    for name in names:
        _set(name, False)


@contextlib.contextmanager
def disabled(names=SHORTCUTS):
    """The shortcuts ``names`` off inside the block, back as they were after it."""
    was = [name for name in names if name in _active]
    uninstall(names)
    try:
        yield
    finally:
        for name in was:
            _set(name, True)


def _set(name: str, on: bool) -> None:
    if name not in SHORTCUTS:
        raise ValueError(f"unknown CPU fast path {name!r}; known: {', '.join(SHORTCUTS)}")
    for module, attribute, stock, ours in LOOKUPS.get(name, ()):
        setattr(module, attribute, ours if on else stock)
    if name in ZERO_PATCHES:
        for optimizer, patched in _zero_optimizers.items():
            _patch_zero(optimizer, patched, name, on)
    (_active.add if on else _active.discard)(name)


def _patch_zero(optimizer, patched: dict, name: str, on: bool) -> None:
    if on and name not in patched:
        made = _zero_made.setdefault(optimizer, {})
        if name not in made:  # made once per optimiser: switched back on, it keeps its buffers
            made[name] = ZERO_PATCHES[name](optimizer)
        attributes = made[name]
        if attributes:  # what the instance held before (DeepSpeed sets some, e.g. ``flatten``), to restore
            patched[name] = {attribute: vars(optimizer).get(attribute, _CLASS) for attribute in attributes}
            for attribute, fn in attributes.items():
                setattr(optimizer, attribute, fn)
    elif not on and name in patched:
        for attribute, before in patched.pop(name).items():
            if before is _CLASS:
                vars(optimizer).pop(attribute, None)  # the class's method again
            else:
                setattr(optimizer, attribute, before)


def install_zero(zero_optimizer) -> list[str]:
    """The installed ZeRO shortcuts on this DeepSpeed ZeRO-1/2 optimiser (none for another optimiser or when
    the room is not installed); returns the names that apply to it. The engine calls it once."""
    if not any(name in _active for name in ZERO_PATCHES):
        return []
    if not isinstance(zero_optimizer, _zero_stage_1_and_2().DeepSpeedZeroOptimizer):
        return []
    patched = _zero_optimizers.setdefault(zero_optimizer, {})
    for name in ZERO_PATCHES:
        if name in _active:
            _patch_zero(zero_optimizer, patched, name, True)
    return list(patched)
