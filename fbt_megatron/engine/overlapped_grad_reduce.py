"""bf16 ZeRO-1's data-parallel gradient all-reduce, started during the boundary backward.

DeepSpeed's BF16_Optimizer (bf16 at ZeRO-1) all-reduces its fp32 gradient accumulators in one pass after
the boundary micro-batch's backward has ended: the whole reduction waits behind backward. With
``immediate_grad_update`` DeepSpeed adds each bf16 gradient to its fp32 accumulator from a hook as backward
makes it; a second hook here counts the parameters of a bucket (consecutive accumulators, one slice of
DeepSpeed's flat buffer) and starts the bucket's all-reduce, asynchronously, once all of them have their
gradient, as Megatron's ``overlap_grad_reduce`` does. :meth:`finish` reduces the buckets the boundary
backward did not complete, waits, and scales as DeepSpeed does (sum, then x 1/dp).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def reason_not_overlapped(ds_engine, dp_size: int) -> str | None:
    """Why this DeepSpeed engine's reduction cannot be replaced by the overlapped one (None: it can)."""
    opt = ds_engine.optimizer
    if type(opt).__name__ != "BF16_Optimizer":
        return f"the optimizer is DeepSpeed's {type(opt).__name__}, not BF16_Optimizer (bf16 at ZeRO-1)"
    if not getattr(opt, "immediate_grad_update", False):
        return "bf16.immediate_grad_update is off"
    if dp_size < 2:
        return "one data-parallel rank: nothing to reduce"
    if getattr(opt, "has_moe_layers", False):
        return "the model has MoE layers"
    if ds_engine.communication_data_type != torch.float32:
        return f"the reduction dtype is {ds_engine.communication_data_type}, not fp32"
    if not (ds_engine.gradient_average and ds_engine.postscale_gradients()
            and ds_engine.gradient_predivide_factor() == 1.0):
        return "DeepSpeed's gradient scaling is not the default (average, post-scaled, no pre-division)"
    if getattr(ds_engine, "sequence_parallel_size", 1) != 1:
        return "DeepSpeed's own sequence parallelism is on"
    return None


class _Bucket:
    """Consecutive accumulators of one parameter group: a contiguous slice of the group's flat buffer."""

    def __init__(self, view: torch.Tensor, size: int):
        self.view, self.size, self.ready, self.work = view, size, 0, None


class OverlappedGradReduce:
    """Replaces DeepSpeed's after-backward all-reduce of a BF16_Optimizer's fp32 gradients (see the module).

    Contract: :meth:`arm` before each ``backward`` (armed only for the accumulation boundary), :meth:`finish`
    after the boundary one; the fp32 accumulators then hold the data-parallel mean, as after DeepSpeed's
    ``allreduce_gradients``. Every data-parallel rank must reach the same parameters in the same order in
    the boundary backward (one graph for all ranks: the pass count is the step's). Built after
    ``deepspeed.initialize``, so its hooks run after DeepSpeed's."""

    def __init__(self, ds_engine, dp_group, bucket_elements: int):
        opt = ds_engine.optimizer
        self.group = dp_group
        self.scale = 1.0 / dist.get_world_size(group=dp_group)
        self.flats = list(opt.fp32_groups_gradients_flat)
        self.buckets: list[_Bucket] = []
        self.armed = False
        for flat, params, grads in zip(self.flats, opt.bf16_groups, opt.fp32_groups_gradients):
            offsets = [0]
            for g in grads:
                offsets.append(offsets[-1] + g.numel())
            # backward reaches the last parameters first: buckets are cut from the end of the group
            stop = len(params)
            for j in reversed(range(len(params))):
                if offsets[stop] - offsets[j] >= bucket_elements or j == 0:
                    self._add_bucket(flat.narrow(0, offsets[j], offsets[stop] - offsets[j]), params[j:stop])
                    stop = j
        ds_engine.enable_backward_allreduce = False  # the reduction is this object's now

    def _add_bucket(self, view: torch.Tensor, params) -> None:
        bucket = _Bucket(view, len(params))
        self.buckets.append(bucket)
        for p in params:  # DeepSpeed's bf16 groups hold only parameters that require a gradient
            p.register_post_accumulate_grad_hook(lambda _p, b=bucket: self._ready(b))

    def _ready(self, bucket: _Bucket) -> None:
        if not self.armed:
            return
        if bucket.work is not None:
            raise RuntimeError("a parameter got a second gradient in the boundary backward after its bucket's "
                               "all-reduce had started; overlapped reduction needs one gradient per parameter")
        bucket.ready += 1
        if bucket.ready == bucket.size:
            bucket.work = dist.all_reduce(bucket.view, group=self.group, async_op=True)

    def in_flight(self) -> int:
        """Buckets whose all-reduce has started in this boundary backward."""
        return sum(b.work is not None for b in self.buckets)

    def arm(self, is_boundary: bool) -> None:
        self.armed = is_boundary
        for bucket in self.buckets:
            bucket.ready, bucket.work = 0, None

    def finish(self) -> None:
        """Reduce the buckets the boundary backward did not complete (in bucket order on every rank), wait
        for every all-reduce, and average."""
        self.armed = False
        for bucket in self.buckets:
            if bucket.work is None:
                bucket.work = dist.all_reduce(bucket.view, group=self.group, async_op=True)
        for bucket in self.buckets:
            bucket.work.wait()
        for flat in self.flats:
            flat.mul_(self.scale)
