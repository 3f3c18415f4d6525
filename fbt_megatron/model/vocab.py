"""Vocabulary padding: the embedding and LM head have ``ModelConfig.padded_vocab_size(TP)`` rows, a
multiple of ``vocab_pad_multiple`` x TP, so every TP rank holds an equal, aligned slice; the tokenizer's
vocabulary (``vocab_size``) stays the logical one.

- Padded rows are never read as inputs (token ids < vocab_size) and their logits are -inf
  (:func:`local_padding_mask`), so they take no probability mass and receive no gradient.
- The padded size depends on TP, the checkpoint must not: :func:`chunked_vocab_factory` stores only
  the logical rows, as ``vocab_pad_multiple``-row chunks of one global tensor
  ``[ceil(vocab_size / multiple) * multiple, D]``, whatever the TP size that saves or loads it.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory


def local_padding_mask(vocab_size: int, padded_vocab_size: int) -> torch.Tensor | None:
    """[V_pad/TP] bool: which of this TP rank's vocabulary columns are padding (None if none)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    per_rank = padded_vocab_size // tp
    columns = torch.arange(rank * per_rank, (rank + 1) * per_rank)
    mask = columns >= vocab_size
    return mask if bool(mask.any()) else None


def chunked_vocab_factory(sh_ten: ShardedTensor, vocab_size: int, chunk: int) -> ShardedTensorFactory:
    """Replace the ShardedTensor of a vocabulary-parallel weight [V_pad/TP, D] by a factory that saves
    its logical rows as ``chunk``-row pieces of a TP-independent global tensor, and on load fills the
    local slice from them (padding-only rows are zero)."""
    if sh_ten.flattened_range is not None or sh_ten.prepend_axis_num:
        raise ValueError(f"{sh_ten.key}: flattened or prepended vocabulary shards are not supported")
    local_rows, first_row = sh_ten.local_shape[0], sh_ten.global_offset[0]
    if local_rows % chunk or first_row % chunk:
        raise ValueError(f"{sh_ten.key}: local vocabulary rows {local_rows} at offset {first_row} are not "
                         f"aligned to model.vocab_pad_multiple={chunk}")
    n_chunks = -(-vocab_size // chunk)  # logical chunks: the same for every TP size
    first_chunk = first_row // chunk
    mine = [j for j in range(local_rows // chunk) if first_chunk + j < n_chunks]
    rest_shape = tuple(sh_ten.local_shape[1:])

    def build(key, data, replica_id, flattened_range):
        if not mine:  # only padding here: a non-main replica of the last chunk (never written; an empty
            # list would be taken for common, non-sharded state)
            placeholder = torch.zeros((chunk, *rest_shape), dtype=data.dtype)
            return [ShardedTensor.from_rank_offsets(key, placeholder, (0, n_chunks - 1, n_chunks),
                                                    replica_id=(1, parallel_state.get_tensor_model_parallel_rank(),
                                                                parallel_state.get_data_parallel_rank()))]
        return [ShardedTensor.from_rank_offsets(key, data[j * chunk:(j + 1) * chunk], (0, first_chunk + j, n_chunks),
                                                replica_id=replica_id) for j in mine]

    def merge(loaded):
        pieces = list(loaded)[: len(mine)]
        dtype = loaded[0].dtype
        padding_rows = local_rows - chunk * len(pieces)
        if padding_rows:
            pieces.append(torch.zeros((padding_rows, *rest_shape), dtype=dtype))
        return torch.cat(pieces)

    return ShardedTensorFactory(sh_ten.key, sh_ten.data, build, merge, sh_ten.replica_id)


def logical_rows_init(vocab_size: int, padded_vocab_size: int, std: float):
    """Embedding init that draws N(0, std) for the logical rows only (padding rows are zero), so the
    global RNG advances by the same amount at every TP size (Megatron's CPU init builds the whole
    [V_pad, D] master weight on every rank, and V_pad depends on TP)."""

    def init(weight: torch.Tensor) -> torch.Tensor:
        if weight.shape[0] != padded_vocab_size:  # a local partition (GPU init): plain normal
            return torch.nn.init.normal_(weight, 0.0, std)
        with torch.no_grad():
            weight.zero_()
            weight[:vocab_size].normal_(0.0, std)
        return weight

    return init


@torch.no_grad()
def reinit_logical_rows(weight: torch.nn.Parameter, vocab_size: int, std: float, seed: int) -> None:
    """Re-draw a vocabulary-parallel weight [V_pad/TP, D] from a TP-independent full [vocab_size, D]
    (its own generator), padding rows zero."""
    from fbt_megatron.model import tp_layout

    full = torch.empty((vocab_size, weight.shape[1]), dtype=torch.float32)
    full.normal_(0.0, std, generator=torch.Generator().manual_seed(seed))
    weight.copy_(tp_layout.to_local("output_layer.weight", full, weight, None).to(weight.dtype))
