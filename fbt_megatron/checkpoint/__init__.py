"""Checkpoints: each rank saves the state it owns and loads what its (possibly new) layout needs.

* :mod:`.manager` - format, atomic publication, pruning, async saves, loading (``load_model_weights``).
* :mod:`.discovery` - the ``latest`` pointer, step directories, ``resolve_checkpoint``,
  ``read_checkpoint_state`` (no torch: the run plan reads them before launch).
* :mod:`.shards` - a rank's fragment of each parameter's fp32 state (found by the engine layer's
  ``ZeroState`` under ZeRO 0-3, as views of DeepSpeed's own buffers) as Megatron ShardedTensor pieces.
* :mod:`.state` - state.json assembled from, and handed back to, the state's owners.
* :mod:`.safe_load` - no-pickle reading of checkpoint metadata.  :mod:`.rng` - RNG states as JSON.
* :mod:`.cli` - ``fbt ckpt inspect|verify DIR``.
"""

from fbt_megatron.checkpoint.discovery import CheckpointError, read_checkpoint_state, resolve_checkpoint

__all__ = ["CheckpointError", "CheckpointManager", "load_model_weights", "read_checkpoint_state",
           "resolve_checkpoint"]


def __getattr__(name: str):
    """The manager's names on first use: finding checkpoints (:mod:`.discovery`) imports no torch."""
    if name in ("CheckpointManager", "load_model_weights"):
        from fbt_megatron.checkpoint import manager

        return getattr(manager, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
