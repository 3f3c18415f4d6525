"""Starting DeepSpeed and the configuration it is given for a recipe (batch, AdamW, ZeRO stage, precision)."""

from __future__ import annotations

import os

from fbt_megatron import runtime

# DeepSpeed's flat gradient-reduction bucket, in elements: the engine's all-reduce of the bf16
# optimiser's fp32 accumulators (``MEMORY_OPT_ALLREDUCE_SIZE``, fixed) and ZeRO-2's ``reduce_bucket_size``.
REDUCE_BUCKET_ELEMENTS = 500_000_000


def ensure_ds_accelerator() -> None:
    """DS_ACCELERATOR must be chosen before ``import deepspeed``."""
    if not runtime.use_cuda():
        os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.setdefault("DS_BUILD_OPS", "0")


def import_deepspeed():
    ensure_ds_accelerator()
    import deepspeed

    if not runtime.use_cuda():
        # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce (used only for inference
        # all-reduce) at comm init: a C++ toolchain and a minute on a fresh machine. Not needed here.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        from deepspeed.accelerator import get_accelerator

        name = get_accelerator().device_name()
        if name != "cpu":
            raise RuntimeError(
                f"deepspeed was imported with accelerator {name!r} before DS_ACCELERATOR=cpu was set; "
                "import fbt_megatron.engine (or set DS_ACCELERATOR=cpu) before deepspeed")
    return deepspeed

def precision_config(recipe) -> dict:
    """DeepSpeed's precision keys for the recipe's resolved precision.

    bf16: fp32 master weights (DeepSpeed's bf16 optimisers), gradients accumulated over
    micro-batches in fp32 (``data_types.grad_accum_dtype``: ZeRO-1 -> DeepSpeed's BF16_Optimizer,
    ZeRO-3 -> fp32 grad partitions) and reduced over data parallelism in
    ``parallel.grad_reduce_dtype`` (``communication_data_type``, fp32 by default). DeepSpeed 0.19
    accumulates in bf16 at ZeRO-0 and ZeRO-2 whatever the config says; a run there starts with a warning
    (``recipe.bf16_accumulation_warning``). ``check_grad_overflow`` makes a non-finite gradient skip the step.
    ``immediate_grad_update`` (ZeRO-1): each bf16 gradient is added to its fp32 accumulator from a hook as
    backward makes it, and released, instead of all of them after backward (the addition overlaps the
    backward and no parameter's gradient is held twice). DeepSpeed all-reduces the fp32 accumulators after
    the boundary's backward; ``parallel.overlap_grad_reduce`` starts them during it instead
    (:mod:`fbt_megatron.engine.overlapped_grad_reduce`).
    """
    if recipe.resolved_precision() != "bf16":
        return {}
    cfg = {"bf16": {"enabled": True, "check_grad_overflow": True,
                    "immediate_grad_update": recipe.parallel.zero_stage == 1},
           "communication_data_type": recipe.parallel.grad_reduce_dtype}
    if recipe.parallel.zero_stage != 0:  # ZeRO-0 raises NotImplementedError on an fp32 accumulation dtype
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def deepspeed_config(recipe, dp_size: int) -> dict:
    b, o = recipe.batch, recipe.optimizer
    cfg = {
        "train_micro_batch_size_per_gpu": b.micro_batch_size,
        "gradient_accumulation_steps": recipe.accumulation_steps(dp_size),
        "train_batch_size": b.global_batch_size,
        "gradient_clipping": o.grad_clip,
        "optimizer": {
            "type": "AdamW",
            # torch's fused AdamW: one kernel per tensor doing every element-wise op of the update (CPU and
            # CUDA); the unfused one streams a flat ZeRO partition through memory ~8 times (timings:
            # docs/results/benchmarks.md, "Measurements behind code choices")
            "params": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay,
                       "torch_adam": True, "adam_w_mode": True, "fused": True},
        },
        "zero_optimization": {"stage": recipe.parallel.zero_stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    cfg.update(precision_config(recipe))
    if recipe.parallel.zero_stage in (1, 2) and not runtime.use_cuda():
        # On CPU a contiguous gradient buffer only adds a copy of every gradient per micro-batch (its cost:
        # docs/results/benchmarks.md); there is no fragmentation to avoid.
        cfg["zero_optimization"]["contiguous_gradients"] = False
    elif recipe.parallel.zero_stage == 2:
        # ZeRO-2 on GPU: each bucket's reduce-scatter runs on a side stream while backward goes on
        # (DeepSpeed's default turns this on at ZeRO-3 only); buckets of REDUCE_BUCKET_ELEMENTS.
        cfg["zero_optimization"].update(overlap_comm=True, contiguous_gradients=True,
                                        reduce_bucket_size=REDUCE_BUCKET_ELEMENTS)
    if recipe.parallel.zero_stage == 3:
        # Small, deterministic buckets; no prefetch reordering surprises on CPU.
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0)
    return cfg
