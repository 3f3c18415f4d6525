"""``model/tensor_memo.py``: a value derived from the last tensor seen, kept while that tensor lives unchanged."""

import gc

import torch

from fbt_megatron.model.tensor_memo import LastTensorMemo


def test_values_kept_per_tensor_while_it_lives_unchanged():
    """A value derived from a tensor (here a boolean mask as 0 / -inf) is computed once for the tensor while
    it lives unchanged, and anew for another tensor, an in-place change or another dtype; under inference
    mode it is computed and not kept; nothing is kept once its tensor is gone."""
    def expected(mask, dtype):  # the memoised function itself: the memo must hand back its current value
        return torch.zeros(mask.shape, dtype=dtype).masked_fill(mask, float("-inf"))

    memo = LastTensorMemo(expected)

    g = torch.Generator().manual_seed(2)
    full_row = torch.zeros(2, 1, 6, 6, dtype=torch.bool).index_fill(2, torch.tensor([3]), True)
    first = (torch.rand(2, 1, 6, 6, generator=g) < 0.5) | full_row  # a fully masked query row
    converted = memo.get(first, torch.float32)
    assert torch.equal(converted, expected(first, torch.float32))
    assert memo.get(first, torch.float32) is converted  # the same mask: converted once
    first_entry = memo._entry  # held (as a reader in another thread may): its callback stays armed
    second = ~first  # same shape and version, other content
    assert torch.equal(memo.get(second, torch.float32), expected(second, torch.float32))
    assert memo.get(second, torch.bfloat16).dtype == torch.bfloat16
    second[1, 0, 2, 4] = ~second[1, 0, 2, 4]  # changed in place
    kept = memo.get(second, torch.bfloat16)
    assert torch.equal(kept, expected(second, torch.bfloat16))
    del first, converted
    gc.collect()
    assert memo.get(second, torch.bfloat16) is kept  # an older mask's death leaves it
    del first_entry
    with torch.inference_mode():  # converted, not kept: an inference tensor cannot be saved for backward
        assert torch.equal(memo.get(second, torch.float32), expected(second, torch.float32))
        made_inside = torch.ones(1, 1, 2, 2, dtype=torch.bool).triu(1)
        assert torch.equal(memo.get(made_inside, torch.float32), expected(made_inside, torch.float32))
    assert torch.float32 not in memo._entry[2]
    entry = memo._entry
    # an inference tensor used outside the mode (a mask the model kept from an inference forward)
    assert torch.equal(memo.get(made_inside, torch.float32), expected(made_inside, torch.float32))
    assert memo._entry is entry
    del entry
    assert memo.get(second, torch.bfloat16) is kept
    del second, kept
    gc.collect()
    assert memo._entry is None  # nothing kept once its mask is gone
