"""The GPU path, run on CPU: bf16 training (DeepSpeed's bf16 optimiser, fp32 masters, fp32 gradient
accumulation and reduction) saves and resumes exactly, and full-model sequence parallelism trains
like plain tensor parallelism."""

import json
import math

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.training import grad_norms, losses, tiny_recipe, train_fn

# bf16 matmuls are slow on CPU: a shorter run on shorter rows than the other training tests.
BF16 = dict(precision="bf16", parallel={"zero_stage": 1}, train={"steps": 3}, data={"seq_length": 16},
            batch={"global_batch_size": 4, "micro_batch_size": 2}, schedule={"feedback_start_step": 1},
            checkpoint={"every": 1000, "at_end": True})


def test_bf16_resume_matches_straight_bf16_run(tmp_path):
    straight = run_distributed(train_fn, 1, tiny_recipe(tmp_path / "straight", **BF16), None, None, None, "engine_info")[0]
    info = straight["probe"]
    assert info["optimizer"] == "BF16_Optimizer" and info["param_dtype"] == "torch.bfloat16"
    assert info["grad_accum_dtype"] == "torch.float32" and info["communication_data_type"] == "torch.float32"
    assert info["master_dtype"] == "torch.float32"
    assert all(math.isfinite(x) for x in losses(straight)) and not any(h[3] for h in straight["history"])
    saved = json.loads(next((tmp_path / "straight").glob("checkpoints/step_*/state.json")).read_text())
    assert saved["layout"]["dtype"] == "bf16"  # the run's precision, not the CPU's default (fp32)

    first = tiny_recipe(tmp_path / "resumed", **BF16)
    first["train"]["stop_at_step"] = 2
    a = run_distributed(train_fn, 1, first)[0]
    b = run_distributed(train_fn, 1, tiny_recipe(tmp_path / "resumed", **BF16))[0]
    assert a["step"] == 2 and b["history"][0][0] == 2 and b["step"] == 3
    assert losses(a) + losses(b) == losses(straight)  # bit-identical: fp32 masters and moments restored
    assert grad_norms(a) + grad_norms(b) == grad_norms(straight)


def test_bf16_zero1_accumulates_each_micro_batch_once(tmp_path):
    """ZeRO-1 bf16 (DeepSpeed's BF16_Optimizer) with 2 micro-batches per step trains like fp32: the same
    gradient norms and losses up to bf16 rounding. Measured (2026-11-30, 4 micro-batches): within 0.25 %;
    with the bf16 gradients left in place after each micro-batch's accumulation the first norm was 3.2x."""
    runs = {p: run_distributed(train_fn, 1, tiny_recipe(tmp_path / p, **dict(BF16, precision=p)))[0]
            for p in ("bf16", "fp32")}
    assert len(runs["bf16"]["history"]) == 3
    for a, b in zip(grad_norms(runs["bf16"]), grad_norms(runs["fp32"])):
        assert abs(a - b) < 1e-2 * b, (grad_norms(runs["bf16"]), grad_norms(runs["fp32"]))
    for a, b in zip(losses(runs["bf16"]), losses(runs["fp32"])):
        assert abs(a - b) < 2e-3, (losses(runs["bf16"]), losses(runs["fp32"]))


def test_bf16_warns_at_stages_that_accumulate_in_bf16():
    from fbt_megatron.recipe import bf16_accumulation_warning, load_recipe

    for stage in (0, 2):
        note = bf16_accumulation_warning(load_recipe(data={"precision": "bf16", "parallel": {"zero_stage": stage}}))
        assert note and f"zero_stage={stage} with bf16 accumulates gradients in bf16" in note
    for stage in (1, 3):
        assert bf16_accumulation_warning(load_recipe(data={"precision": "bf16", "parallel": {"zero_stage": stage}})) is None
    assert bf16_accumulation_warning(load_recipe(data={"precision": "fp32", "parallel": {"zero_stage": 0}})) is None


# Each place a ZeRO stage keeps the gradient the optimiser steps (engine/sequence_parallel_grads.py): the
# parameter's own (ZeRO-0 fp32), the fragment of ZeRO-1/2's partition (over 2 DP ranks: the fragments
# differ per rank), ZeRO-3's fp32 partition, bf16 ZeRO-1's fp32 accumulators (BF16_Optimizer: over 2 DP ranks,
# where each rank's gradient norm reads every parameter's accumulator, its own partition or not), and ZeRO-2
# under a 2-stage pipeline (the step's one backward at the end of the pipeline schedule).
SP_LAYOUTS = [(0, "fp32", 1, 1), (1, "fp32", 1, 1), (2, "fp32", 2, 1), (3, "fp32", 1, 1), (1, "bf16", 2, 1),
              (2, "fp32", 1, 2)]


@pytest.mark.parametrize("zero_stage,precision,dp,pp", SP_LAYOUTS,
                         ids=[f"zero{z}-{p}-dp{d}-pp{pp}" for z, p, d, pp in SP_LAYOUTS])
def test_sequence_parallel_trains_like_tensor_parallel(tmp_path, zero_stage, precision, dp, pp):
    """Sequence-parallel norms see half the sequence each; summed over TP once a step, training matches
    TP without SP: losses, gradient norms and final parameters."""
    tol = 1e-5 if precision == "fp32" else 2e-2  # bf16: the two layouts round their matmuls differently
    overrides = dict(BF16, parallel={"zero_stage": zero_stage}) if precision == "bf16" else {}
    runs = {}
    for sp in (False, True):
        recipe = tiny_recipe(tmp_path / f"sp{sp}", **overrides)
        recipe["parallel"].update({"tensor": 2, "pipeline": pp, "zero_stage": zero_stage, "sequence_parallel": sp})
        recipe["batch"]["global_batch_size"] *= dp
        runs[sp] = run_distributed(train_fn, 2 * dp * pp, recipe, None, None, None, "final_params")[0]
    assert max(h[1] for h in runs[False]["history"]) > 1  # feedback passes included
    for a, b in zip(losses(runs[False]), losses(runs[True])):
        assert abs(a - b) < tol, (losses(runs[False]), losses(runs[True]))
    for a, b in zip(grad_norms(runs[False]), grad_norms(runs[True])):
        assert abs(a - b) / a < tol, (grad_norms(runs[False]), grad_norms(runs[True]))
    for name, value in runs[False]["probe"].items():
        torch.testing.assert_close(runs[True]["probe"][name], value, rtol=tol, atol=tol, msg=name)


def test_sequence_parallel_needs_sequence_divisible_by_tp():
    from fbt_megatron.recipe import RecipeError, check_layout, load_recipe

    recipe = load_recipe(data={"parallel": {"tensor": 2, "sequence_parallel": True},
                               "data": {"seq_length": 63}, "model": {"max_sequence_length": 64}})
    with pytest.raises(RecipeError, match=r"data.seq_length=63 is not divisible by parallel.tensor=2"):
        check_layout(recipe, 2)


def test_sequence_parallel_grads_reduced_once_a_step_in_fp32(tmp_path):
    """The sequence-parallel gradients cross the TP group as one flat fp32 all-reduce a step (after the
    last micro-batch's backward), not one bf16 all-reduce per parameter and micro-batch. The other TP
    all-reduces inside backward are the fusion's activation gradients, each larger than all the
    sequence-parallel parameters together in this model."""
    recipe = tiny_recipe(tmp_path, **dict(BF16, parallel={"tensor": 2, "zero_stage": 1, "sequence_parallel": True}))
    out = run_distributed(train_fn, 2, recipe, None, None, None, "tp_all_reduces_in_backward")[0]
    sp = out["probe"]["sp_elements"]
    assert len(out["probe"]["calls"]) == 3 and max(h[1] for h in out["history"]) > 1
    for calls in out["probe"]["calls"]:
        assert calls.count(("torch.float32", sp)) == 1, calls
        assert all(numel > sp for dtype, numel in calls if (dtype, numel) != ("torch.float32", sp)), calls
