"""The four places where the engine replaces a DeepSpeed method, and the DeepSpeed versions they were
written against (``tests/test_engine_patches.py`` fails on any other version, so an upgrade is a
deliberate re-check of all four):

1. :class:`SkippableStep` replaces the inner torch optimiser's ``step`` so a step can be skipped
   entirely (non-finite loss) and so the engine learns whether DeepSpeed stepped at all (it does not
   when it finds the gradient non-finite).
2. :func:`replace_zero0_clipping` replaces ``DeepSpeedEngine.clip_fp32_gradients`` (called only at
   ZeRO-0 in fp32, from ``_take_model_step``) with clipping that counts every parameter once over TP
   and PP (see :meth:`Engine._clip_fp32_gradients`).
3. :func:`skip_one_rank_all_reduce` replaces ZeRO-1/2's ``allreduce_and_copy`` when the data-parallel group
   has one rank: DeepSpeed flattens the gradients into a fresh bucket (one copy of every gradient; at
   28M parameters a 116 MB allocation per step, which the allocator maps fresh and the kernel faults in
   page by page), divides by 1, all-reduces over the one rank and copies each gradient back. All of
   that is the identity; what it feeds on (the gradient, cast to the communication dtype and back,
   added to ZeRO's gradient-partition buffer where one is given) is kept. Scope: the buckets that reach
   ``allreduce_and_copy``, i.e. fp32 gradients without ``contiguous_gradients`` (this project's CPU runs);
   contiguous gradients (GPU), bf16 ZeRO-2's fp32 partition buffer and bf16 ZeRO-1 (``BF16_Optimizer``)
   still go through DeepSpeed's ``allreduce_bucket``.
4. :func:`keep_flat_grad_partition` gives ZeRO-1/2's step, on CPU, a kept buffer for the flat fp32
   gradient partition it builds every step (``flatten_dense_tensors_aligned`` or ``flatten`` of
   ``averaged_gradients[i]``): DeepSpeed concatenates into a fresh tensor the size of the partition (420 MB
   at 105M parameters), which on CPU is mapped fresh and faulted in page by page, every step. The values
   are the same copy. The cost: the buffer stays allocated through forward and backward, where the fresh
   tensor lived only during the step, so the peak memory can rise by the partition's size in fp32. On GPU
   the caching allocator already reuses the memory: not installed.
"""

from __future__ import annotations

import torch

# DeepSpeed (major, minor) versions whose internals the patches below were checked against.
PATCHED_DEEPSPEED = ((0, 19),)


def deepspeed_version() -> tuple[int, int]:
    import deepspeed

    major, minor = deepspeed.__version__.split(".")[:2]
    return int(major), int(minor)


class SkippableStep:
    """Wraps the inner optimiser's ``step`` so the train step can skip one step entirely, and
    records whether DeepSpeed called it (it does not when it finds the gradient non-finite)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.skip_next = False
        self.stepped = False
        self._step = optimizer.step

        def step(*args, **kwargs):
            if self.skip_next:
                return None
            self.stepped = True
            return self._step(*args, **kwargs)

        optimizer.step = step


def replace_zero0_clipping(ds, clip) -> None:
    """ZeRO-0 fp32 clipping: DeepSpeed calls ``engine.clip_fp32_gradients()`` inside ``ds.step()``."""
    if hasattr(ds, "clip_fp32_gradients"):
        ds.clip_fp32_gradients = clip


def skip_one_rank_all_reduce(zero_optimizer) -> bool:
    """At a one-rank data-parallel group, ZeRO-1/2's reduction of a gradient bucket without the flatten,
    the division by 1 and the all-reduce over one rank (3. above); any other group, DeepSpeed's own.
    Returns whether the optimiser was patched (a DeepSpeed ZeRO-1/2 optimiser over one rank)."""
    from deepspeed import comm as dist
    from deepspeed.runtime.zero import stage_1_and_2

    if not isinstance(zero_optimizer, stage_1_and_2.DeepSpeedZeroOptimizer):
        return False
    original = zero_optimizer.allreduce_and_copy

    def allreduce_and_copy(small_bucket, communication_data_type, rank=None, log=None, divide=True,
                           process_group=None, output_bucket=None):
        group = zero_optimizer.dp_process_group if process_group is None else process_group
        if (dist.get_world_size(group=group) != 1 or zero_optimizer.overlap_comm or stage_1_and_2.pg_correctness_test
                or zero_optimizer.sequence_parallel_size != 1):
            return original(small_bucket, communication_data_type, rank=rank, log=log, divide=divide,
                            process_group=process_group, output_bucket=output_bucket)
        outputs = output_bucket if output_bucket is not None else [None] * len(small_bucket)
        for grad, output in zip(small_bucket, outputs):
            # what the bucket carried: the gradient in the communication dtype, divided by a world size of
            # one (exact) and summed over one rank
            synced = grad.to(communication_data_type)
            zero_optimizer._add_to_grad_partition_buffer(output, synced)
            if synced is not grad:
                grad.copy_(synced)

    zero_optimizer.allreduce_and_copy = allreduce_and_copy
    return True


def keep_flat_grad_partition(zero_optimizer) -> bool:
    """ZeRO-1/2's flat fp32 gradient partition written into a buffer kept between steps (4. above), for
    a DeepSpeed ZeRO-1/2 optimiser on CPU without offload; returns whether it was installed. Only the
    flatten of ``averaged_gradients[i]`` (the list object itself) takes the buffer; every other flatten
    (parameters at start-up, checkpoint loading, gradient buckets) is DeepSpeed's. The step hands the
    partition to the inner optimiser as ``.grad`` and drops it after that group's update, before the
    next group's flatten, so one buffer per size serves every group."""
    from deepspeed.runtime.zero import stage_1_and_2

    if (not isinstance(zero_optimizer, stage_1_and_2.DeepSpeedZeroOptimizer) or zero_optimizer.cpu_offload
            or any(p.device.type != "cpu" for p in zero_optimizer.single_partition_of_fp32_groups)):
        return False
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

    def flatten_dense_tensors_aligned(tensor_list, alignment, use_cpu_data=False, param_padding=None):
        if is_grad_partition(tensor_list) and not use_cpu_data and param_padding is None:
            return into_kept(tensor_list, alignment)
        return original_aligned(tensor_list, alignment, use_cpu_data=use_cpu_data, param_padding=param_padding)

    zero_optimizer.flatten = flatten
    zero_optimizer.flatten_dense_tensors_aligned = flatten_dense_tensors_aligned
    return True
