"""bf16 ZeRO-1's data-parallel gradient all-reduce, started during the boundary backward.

DeepSpeed's BF16_Optimizer (bf16 at ZeRO-1) all-reduces its fp32 gradient accumulators in one pass after
the boundary micro-batch's backward has ended: the whole reduction waits behind backward. With
``immediate_grad_update`` DeepSpeed adds each bf16 gradient to its fp32 accumulator from a hook as backward
makes it; a second hook here then starts that accumulator's all-reduce (asynchronous, one per parameter),
so the reduction runs while backward goes on, as Megatron's ``overlap_grad_reduce`` does. :meth:`finish`
reduces the accumulators the boundary backward did not reach, waits, and scales as DeepSpeed does (sum,
then x 1/dp), so the result is DeepSpeed's reduction.
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


class OverlappedGradReduce:
    """Replaces DeepSpeed's after-backward all-reduce of a BF16_Optimizer's fp32 gradients (see the module).

    Contract: :meth:`arm` before each ``backward`` (armed only for the accumulation boundary), :meth:`finish`
    after the boundary one; the fp32 accumulators then hold the data-parallel mean, as after DeepSpeed's
    ``allreduce_gradients``. Built after ``deepspeed.initialize``, so its hooks run after DeepSpeed's."""

    def __init__(self, ds_engine, dp_group):
        opt = ds_engine.optimizer
        self.group = dp_group
        self.scale = 1.0 / dist.get_world_size(group=dp_group)
        self.flats = list(opt.fp32_groups_gradients_flat)
        # (group index, parameter index) -> that parameter's fp32 accumulator, a view of the group's flat buffer
        self.accumulators = {(i, j): g for i, grads in enumerate(opt.fp32_groups_gradients) for j, g in enumerate(grads)}
        self.armed = False
        self.works: dict[tuple[int, int], object] = {}
        self.hooks = []
        for i, params in enumerate(opt.bf16_groups):
            for j, param in enumerate(params):
                if param.requires_grad:
                    self.hooks.append(param.register_post_accumulate_grad_hook(self._hook_for(i, j)))
        ds_engine.enable_backward_allreduce = False  # the reduction is this object's now

    def _hook_for(self, i: int, j: int):
        def start_reduce(_param):
            if not self.armed:
                return
            if (i, j) in self.works:
                raise RuntimeError(f"parameter ({i}, {j}) got a second gradient in the boundary backward after its "
                                   "all-reduce had started; overlapped reduction needs one gradient per parameter")
            self.works[(i, j)] = dist.all_reduce(self.accumulators[(i, j)], group=self.group, async_op=True)

        return start_reduce

    def arm(self, is_boundary: bool) -> None:
        self.armed = is_boundary

    def finish(self) -> None:
        """Reduce what the boundary backward did not reach, wait for every all-reduce, and average."""
        self.armed = False
        for key, accumulator in self.accumulators.items():
            if key not in self.works:
                self.works[key] = dist.all_reduce(accumulator, group=self.group, async_op=True)
        for work in self.works.values():
            work.wait()
        self.works.clear()
        for flat in self.flats:
            flat.mul_(self.scale)
