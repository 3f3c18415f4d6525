"""A checkpoint's per-rank RNG state (fbt_megatron/checkpoint/rng.py): after ``set_rng_state`` of a saved
``rng_state()`` (through JSON, as the checkpoint stores it), every generator it holds — python's
``random``, numpy's global generator, torch's CPU generator and Megatron's model-parallel tracker, which
drives attention dropout — draws what it drew right after the save."""

import json
import random

import numpy as np
import pytest
import torch


def draws() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    with get_cuda_rng_tracker().fork():  # the model-parallel-rng state (attention dropout)
        tracker = torch.rand(4).tolist()
    return {"python": [random.random() for _ in range(3)], "python_gauss": [random.gauss() for _ in range(3)],
            "numpy": np.random.rand(3).tolist(),
            "numpy_normal": np.random.standard_normal(3).tolist(),  # the cached Gaussian (state[3:5]) too
            "torch": torch.rand(3).tolist(), "tracker": tracker}


@pytest.mark.parametrize("cached_gaussian", [True, False])
def test_every_generator_draws_the_same_after_a_round_trip(single_process, cached_gaussian):
    """Also the Gaussians python and numpy draw in pairs and cache the second of (random.gauss,
    numpy's legacy standard_normal): saved with a cached one and without."""
    from fbt_megatron.checkpoint.rng import rng_state, set_rng_state

    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    if cached_gaussian:
        random.gauss(), np.random.standard_normal()  # each leaves its pair's second value cached
    else:
        random.random(), np.random.rand()
    saved = json.loads(json.dumps(rng_state()))  # as written to rng/rank_N.json
    assert set(saved) >= {"python", "numpy", "torch", "tracker"}
    first = draws()
    assert draws() != first  # the generators moved on
    set_rng_state(saved)
    assert draws() == first

