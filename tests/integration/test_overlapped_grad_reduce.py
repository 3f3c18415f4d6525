"""bf16 at ZeRO-1 over two data-parallel ranks: the all-reduce of the fp32 gradient accumulators starts
during the boundary backward (engine/overlapped_grad_reduce.py) and gives what DeepSpeed's own reduction
after backward gives, bit for bit: the reduced gradients of every step, the losses and the final fp32
masters; DeepSpeed's reduction is itself checked against the formula, the mean of the ranks' accumulators."""

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.training import losses, tiny_recipe, train_fn

pytestmark = pytest.mark.slow

# bf16 matmuls are slow on CPU: short rows; 2 micro-batches per rank and step; feedback from step 1
BF16_DP2 = dict(precision="bf16", parallel={"zero_stage": 1}, train={"steps": 3}, data={"seq_length": 16},
                batch={"global_batch_size": 8, "micro_batch_size": 2}, schedule={"feedback_start_step": 1})


def _run(tmp_path, overlap: bool, pipeline: int):
    recipe = tiny_recipe(tmp_path / f"overlap{overlap}", **BF16_DP2)
    # buckets of >= 5,000 elements: several per group, some of one parameter (the embedding: 8,192), some of many
    recipe["parallel"].update(overlap_grad_reduce=overlap, pipeline=pipeline, grad_reduce_bucket_elements=5000)
    return run_distributed(train_fn, 2 * pipeline, recipe, None, None, None, "reduced_grads")


@pytest.mark.parametrize("pipeline", [1, 2], ids=["pp1", "pp2"])
def test_overlapped_reduction_equals_deepspeeds(tmp_path, pipeline):
    """pp1: each bucket's reduction starts in the last micro-batch's backward once its parameters have their
    gradients. pp2: the pipeline's boundary backward reaches one parameter, so the buckets are reduced by
    :meth:`finish`."""
    ours, theirs = _run(tmp_path, True, pipeline), _run(tmp_path, False, pipeline)
    assert all(r["probe"]["overlapped"] for r in ours) and not any(r["probe"]["overlapped"] for r in theirs)
    assert max(h[1] for h in ours[0]["history"]) > 1  # a multi-pass step: the fusion's gradients too
    for rank in range(2 * pipeline):
        assert losses(ours[rank]) == losses(theirs[rank])
        steps_ours, steps_theirs = ours[rank]["probe"]["steps"], theirs[rank]["probe"]["steps"]
        assert len(steps_ours) == len(steps_theirs) == 3  # ours: DeepSpeed's reduction never ran as well
        for step, (a, b) in enumerate(zip(steps_ours, steps_theirs), 1):
            passes = ours[rank]["history"][step - 1][1]
            if pipeline == 1 and passes > 1:  # every bucket's all-reduce started before the backward returned
                assert a["started_in_backward"] == a["buckets"] > 2, (step, a)
            elif pipeline == 1:  # 1 pass: the fusion's bucket(s) not reached, reduced by finish()
                assert 0 < a["started_in_backward"] < a["buckets"], (step, a)
            for x, y in zip(a["reduced"], b["reduced"], strict=True):
                assert torch.equal(x, y), (rank, step)
        for name, value in ours[rank]["probe"]["params"].items():
            assert torch.equal(value, theirs[rank]["probe"]["params"][name]), name
    # DeepSpeed's reduction is the mean over the two ranks of their accumulators (the formula)
    for step in range(3):
        before = [theirs[r]["probe"]["steps"][step]["before"] for r in (0, 1)]
        assert not all(torch.equal(b0, b1) for b0, b1 in zip(*before))  # the ranks saw different data
        for g, (b0, b1) in enumerate(zip(*before)):
            expected = (b0 + b1) * 0.5
            assert torch.equal(theirs[0]["probe"]["steps"][step]["reduced"][g], expected), (step, g)
