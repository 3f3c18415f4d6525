"""Checkpoints: each rank saves the state it owns and loads what its (possibly new) layout needs.

* :mod:`.manager` - format, atomic publication, pruning, async saves, loading; the public helpers
  ``resolve_checkpoint``, ``read_checkpoint_state``, ``load_model_weights``.
* :mod:`.shards` - a rank's fragment of each parameter's fp32 state (found by the engine layer's
  ``ZeroState`` under ZeRO 0-3, as views of DeepSpeed's own buffers) as Megatron ShardedTensor pieces.
* :mod:`.state` - state.json assembled from, and handed back to, the state's owners.
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
