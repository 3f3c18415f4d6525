"""The tensor-parallel sum of sequence-parallel gradients, once per step.

Under sequence parallelism, parameters Megatron marks ``sequence_parallel`` (norm weights, and biases
applied inside a sequence-split region) see only this rank's chunk of the sequence, so each TP rank
holds a partial gradient. :func:`reduce_sequence_parallel_grads` sums them over the TP group as one flat
fp32 all-reduce after the step's last backward, as Megatron-Core's ``finalize_model_grads`` does, instead
of one blocking low-precision all-reduce per parameter and micro-batch. It runs after DeepSpeed's
data-parallel reduction, on the gradient the optimiser will read, wherever the ZeRO stage keeps it: sums
over TP and DP commute, and by then every micro-batch has been accumulated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist


def sequence_parallel_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable parameters whose gradients are partial over the TP group, in module order
    (the same order on every TP rank: the ranks' models have the same structure)."""
    return [p for p in model.parameters() if p.requires_grad and getattr(p, "sequence_parallel", False)]


def _bf16_accumulators(optimizer) -> dict[int, torch.Tensor]:
    """DeepSpeed's BF16_Optimizer (bf16 ZeRO-0/1): id(param) -> its full fp32 gradient accumulator. Every DP
    rank holds all of them, reduces all of them over DP and counts all of them in the gradient norm."""
    groups, grads = getattr(optimizer, "bf16_groups", None), getattr(optimizer, "fp32_groups_gradients", None)
    if groups is None or grads is None:
        return {}
    return {id(p): grads[i][j] for i, group in enumerate(groups) for j, p in enumerate(group)}


def _optimizer_grads(params: Iterable[torch.nn.Parameter], optimizer=None) -> Iterator[tuple[torch.Tensor, Callable | None]]:
    """(gradient the optimiser reads, how to write it back or None for in place) per parameter, for the
    part of it this data-parallel rank holds. TP peers share their DP rank, hence the same layout."""
    accumulators = _bf16_accumulators(optimizer)
    for p in params:
        if id(p) in accumulators:  # bf16 ZeRO-0/1: the whole fp32 accumulator (the norm reads all of it)
            yield accumulators[id(p)], None
        elif hasattr(p, "ds_id"):  # ZeRO-3: this rank's fp32 partition
            from deepspeed.utils import safe_get_local_grad, safe_set_local_grad

            yield safe_get_local_grad(p), lambda value, p=p: safe_set_local_grad(p, value)
        elif hasattr(p, "_hp_mapping"):  # ZeRO-1/2: the fragment of this rank's partition
            if p._hp_mapping is not None:  # None: no part of p in this rank's partition
                yield p._hp_mapping.get_lp_grad_fragment(p._index_in_param_group), None
        elif p.grad is not None:  # ZeRO-0 in fp32: the parameter's own gradient
            yield p.grad, None


def reduce_sequence_parallel_grads(params: Iterable[torch.nn.Parameter], group, optimizer=None) -> int:
    """Sum ``params``' gradients over the TP ``group`` in one fp32 all-reduce; call it on every TP rank
    after the accumulation boundary's backward and before the optimiser step. ``optimizer``: DeepSpeed's
    (None: the parameters' own ``.grad``). Returns the elements reduced (0: nothing held here, no collective)."""
    grads = list(_optimizer_grads(params, optimizer))
    if not grads:
        return 0
    flat = torch.cat([g.reshape(-1).to(torch.float32) for g, _ in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for grad, write_back in grads:
        summed = flat[offset:offset + grad.numel()].view_as(grad)
        offset += grad.numel()
        if write_back is None:
            grad.copy_(summed)
        else:
            write_back(summed)
    return flat.numel()
