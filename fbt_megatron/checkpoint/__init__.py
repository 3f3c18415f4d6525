"""Checkpoints: each rank saves the state it owns and loads what its (possibly new) layout needs.

* :mod:`.manager` - format, atomic publication, pruning, async saves, loading; the public helpers
  ``resolve_checkpoint``, ``read_checkpoint_state``, ``load_model_weights``.
* :mod:`.shards` - which fragment of each parameter's fp32 state a rank owns under ZeRO 0-3 (DeepSpeed's
  own partition views) and how it becomes Megatron ShardedTensor pieces.
* :mod:`.safe_load` - no-pickle reading of checkpoint metadata.  :mod:`.rng` - RNG states as JSON.
* :mod:`.cli` - ``fbt ckpt inspect|verify DIR``.
"""

from fbt_megatron.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    load_model_weights,
    read_checkpoint_state,
    resolve_checkpoint,
)

__all__ = ["CheckpointError", "CheckpointManager", "load_model_weights", "read_checkpoint_state",
           "resolve_checkpoint"]
