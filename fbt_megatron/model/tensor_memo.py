"""Values derived from the last tensor seen, kept while that tensor lives unchanged.

The model hands every layer and every pass of a forward the same tensors (RoPE's frequencies), and
Megatron's layers derive the same values from them in every call (cos/sin, ``model/cpu_fastpaths.py``'s
RoPE). :class:`LastTensorMemo` computes them once per tensor and dtype. The key is the tensor's identity
(a weak reference) and its version counter, so an in-place change through autograd's view of the tensor is
seen; a write the counter does not see (through ``.data`` or ``.numpy()``) is not, and nothing here writes
these tensors that way. The values go when their tensor dies. Under ``torch.inference_mode``, or for an inference tensor, the memo is neither
read nor written: an inference tensor has no version counter, and a value computed there could not be
saved for a later backward.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch


class LastTensorMemo:
    """``compute(tensor, dtype)`` for the last tensor seen, per dtype. The entry (weak reference, version,
    values by dtype) is replaced as one attribute and read once, so a reader never pairs one tensor's key
    with another's values. ``compute`` must return new tensors, not ``tensor`` or a view of it: the memo
    would keep the tensor alive, and never release the values."""

    def __init__(self, compute: Callable[[torch.Tensor, torch.dtype], object]):
        self._compute = compute
        self._entry = None

    def _forget(self, ref) -> None:
        entry = self._entry
        if entry is not None and entry[0] is ref:  # a tensor that died after a newer one took its place: keep that
            self._entry = None

    def get(self, tensor: torch.Tensor, dtype: torch.dtype):
        if torch.is_inference_mode_enabled() or tensor.is_inference():
            return self._compute(tensor, dtype)
        entry = self._entry
        if entry is None or entry[0]() is not tensor or entry[1] != tensor._version:
            entry = (weakref.ref(tensor, self._forget), tensor._version, {})
            self._entry = entry
        by_dtype = entry[2]
        if dtype not in by_dtype:
            by_dtype[dtype] = self._compute(tensor, dtype)
        return by_dtype[dtype]
