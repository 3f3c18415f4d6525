"""The DeepSpeed/Megatron engine glue, below both training and checkpoints.

* :mod:`.deepspeed_config` - choosing DeepSpeed's accelerator before import, its config for a recipe.
* :mod:`.mpu` - Megatron's parallel groups under DeepSpeed's ``mpu`` names.
* :mod:`.param_groups` - AdamW's parameter groups (decay, no decay, the fusion decayed from the feedback start).
* :mod:`.patches` - the two DeepSpeed methods the engine replaces for correctness, pinned to the DeepSpeed
  versions checked (ZeRO-1/2's CPU speed shortcuts are ``model/cpu_fastpaths.py``'s).
* :mod:`.sequence_parallel_grads` - the TP sum of sequence-parallel gradients, one fp32 all-reduce a step.
* :mod:`.overlapped_grad_reduce` - bf16 ZeRO-1's data-parallel all-reduce, started during the boundary backward.
* :mod:`.engine` - :class:`Engine`: DeepSpeed initialised over the model, the step protocol (lr, skip, norm).
* :mod:`.zero_state` - where this rank's fp32 masters and AdamW moments live inside DeepSpeed (ZeRO 0-3).

Importing this package does not import DeepSpeed (``ensure_ds_accelerator`` must run first).
"""

from fbt_megatron.engine.deepspeed_config import (
    deepspeed_config,
    ensure_ds_accelerator,
    import_deepspeed,
    precision_config,
)
from fbt_megatron.engine.engine import Engine, OptimizerOutcome, model_parallel_grad_norm
from fbt_megatron.engine.mpu import MegatronMPU
from fbt_megatron.engine.param_groups import (
    fusion_decay_start,
    fusion_weight_decay,
    is_embedding,
    is_fusion,
    no_weight_decay,
    param_groups,
)

__all__ = ["Engine", "MegatronMPU", "OptimizerOutcome", "deepspeed_config", "ensure_ds_accelerator",
           "fusion_decay_start", "fusion_weight_decay", "import_deepspeed", "is_embedding", "is_fusion",
           "model_parallel_grad_norm", "no_weight_decay", "param_groups", "precision_config"]
