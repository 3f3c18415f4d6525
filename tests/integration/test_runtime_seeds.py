"""Megatron's RNG tracker is seeded per pipeline stage (Megatron-LM's convention: seed + 100 x pipeline
rank, the tensor-parallel state + 2718 + TP rank): on CPU the tracker's states, on CUDA through Megatron's
model_parallel_cuda_manual_seed. References are the formula's numbers drawn from fresh generators."""

import torch

from fbt_megatron import runtime
from fbt_megatron.runtime import ParallelLayout
from tests.support.distributed import run_distributed

SEED = 1234


def expected_draws(seed: int, tp: int, pp: int) -> dict:
    stage = seed + 100 * pp
    return {name: torch.rand(4, generator=torch.Generator().manual_seed(value))
            for name, value in (("data-parallel-rng", stage), ("model-parallel-rng", stage + 2718 + tp),
                                ("expert-parallel-rng", stage + 1024))}


def tracker_draws() -> tuple:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    tracker = mp_random.get_cuda_rng_tracker()
    draws = {}
    for name in ("data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"):
        with tracker.fork(name):
            draws[name] = torch.rand(4)
    return (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank(), draws)


def test_each_pipeline_stage_draws_its_own_stream():
    per_rank = run_distributed(tracker_draws, 2, layout=ParallelLayout(pipeline=2), seed=SEED)
    assert [(tp, pp) for tp, pp, _ in per_rank] == [(0, 0), (0, 1)]
    for tp, pp, draws in per_rank:
        for name, value in expected_draws(SEED, tp, pp).items():
            torch.testing.assert_close(draws[name], value, rtol=0, atol=0)
    assert not torch.equal(per_rank[0][2]["model-parallel-rng"], per_rank[1][2]["model-parallel-rng"])


def test_seeds_by_rank_and_the_cuda_call(monkeypatch, single_process):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    assert runtime.model_parallel_seeds(SEED, tp_rank=1, pp_rank=3) == {
        "data-parallel-rng": SEED + 300, "model-parallel-rng": SEED + 300 + 2718 + 1, "expert-parallel-rng": SEED + 1324}
    calls = []
    monkeypatch.setattr(runtime, "use_cuda", lambda: True)
    monkeypatch.setattr(mp_random, "model_parallel_cuda_manual_seed", lambda seed, **kw: calls.append((seed, kw)))
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda *a, **k: 2)
    runtime.seed_model_parallel_rngs(SEED)
    assert calls == [(SEED + 200, {})]  # Megatron adds 2718 + TP rank to the stage's seed itself
