"""ZeRO-2 under pipeline parallelism reduces each gradient once per step: the stage's gradients of the
m x k stage-pass backward ops are summed outside DeepSpeed and handed to it in one engine.backward (before,
every op went through engine.backward and ZeRO-2's hooks reduced every gradient again). The step's
gradient norm equals ZeRO-1's (which reduces once, at the accumulation boundary)."""

import pytest
import torch

from fbt_megatron.runtime import ParallelLayout
from tests.support.distributed import run_distributed

MICRO_BATCHES = 4  # global batch 8, micro-batch 2, DP=1


class TwoPasses:
    def num_passes(self, step):
        return 2


def step_counts(run_dir: str, zero_stage: int):
    from fbt_megatron import runtime
    from fbt_megatron.data.loaders import build_train_loader
    from fbt_megatron.engine import Engine
    from fbt_megatron.model.fbt_gpt import build_model
    from fbt_megatron.parallel.runner import get_runner
    from fbt_megatron.recipe import load_recipe
    from fbt_megatron.train.train_step import FBTTrainStep
    from tests.support.training import tiny_recipe

    recipe = load_recipe(data=tiny_recipe(run_dir, parallel={"pipeline": 2, "zero_stage": zero_stage}))
    torch.manual_seed(0)
    engine = Engine(build_model(recipe.model, recipe.feedback), recipe)
    counts = {"backward": 0, "reductions": {}}
    real_backward = engine.ds.backward

    def backward(*a, **k):
        counts["backward"] += 1
        return real_backward(*a, **k)

    engine.ds.backward = backward
    optimizer = engine.ds.optimizer
    real_reduce = optimizer.reduce_independent_p_g_buckets_and_remove_grads

    def reduce(param, i):  # ZeRO-2's per-gradient reduction (its hook's work)
        counts["reductions"][id(param)] = counts["reductions"].get(id(param), 0) + 1
        return real_reduce(param, i)

    optimizer.reduce_independent_p_g_buckets_and_remove_grads = reduce
    step = FBTTrainStep(engine, get_runner(engine.model, engine), TwoPasses(), recipe.seed, runtime.device())
    it = iter(build_train_loader(recipe, 0, 1, 0))
    batches = [next(it) for _ in range(recipe.accumulation_steps(1))]
    assert len(batches) == MICRO_BATCHES
    result = step(1, batches, 3e-3)
    params = sum(1 for p in engine.model.parameters() if p.requires_grad)
    return {"backward": counts["backward"], "reductions": sorted(set(counts["reductions"].values())),
            "reduced_params": len(counts["reductions"]), "params": params, "grad_norm": result.grad_norm,
            "loss": float(result.loss)}


@pytest.mark.parametrize("zero_stage", [2])
def test_zero2_pipeline_reduces_each_gradient_once_per_step(tmp_path, zero_stage):
    got = run_distributed(step_counts, 2, str(tmp_path / "z2"), 2, layout=ParallelLayout(pipeline=2))
    reference = run_distributed(step_counts, 2, str(tmp_path / "z1"), 1, layout=ParallelLayout(pipeline=2))
    for stage, (z2, z1) in enumerate(zip(got, reference)):
        assert z2["backward"] == 1, (stage, z2)  # one engine.backward a step (2 passes x 4 micro-batches of ops)
        assert z2["reductions"] == [1] and z2["reduced_params"] == z2["params"], (stage, z2)
        assert z2["loss"] == pytest.approx(z1["loss"], rel=1e-6)
        assert z2["grad_norm"] == pytest.approx(z1["grad_norm"], rel=1e-5), (stage, z2["grad_norm"], z1["grad_norm"])
