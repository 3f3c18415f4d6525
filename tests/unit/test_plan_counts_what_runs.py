"""`fbt plan` counts what the run executes: the attention backend the recipe will run (scores only
where attention runs unfused), the MFU that training logs counts passes as the plan does, and a GELU
model trains with the exact GELU its export computes."""

import dataclasses
import functools
import math

import pytest
import torch

from fbt_megatron.launch.plan import GB, plan
from fbt_megatron.passes import step_forwards
from fbt_megatron.train.callbacks import model_flops_per_token
from fbt_megatron.recipe import load_recipe

RECIPE = "recipes/fbt-1b-400b.yaml"
SCORES = 5 * 32 * 2048 ** 2 * 4  # 5·a·s²·b bytes of one layer's scores at 2-byte activations (TP=1)


def test_training_flops_count_passes_by_grad_mode():
    forward = 2 * 1000 + 4 * 2 * 16 * 8  # F = 2 N_mm + 4 L S h with N_mm=1000, L=2, S=16, h=8
    assert model_flops_per_token(1000, 2, 8, 16, 1) == 3 * forward
    assert model_flops_per_token(1000, 2, 8, 16, 3, "all") == 9 * forward  # 3 forwards + 3 backwards (2F)
    assert model_flops_per_token(1000, 2, 8, 16, 3, "last") == 5 * forward  # 3 forwards + 1 backward
    assert step_forwards(2, "last") == 4
    # the fusion (2 x 2h^2 = 256 FLOPs forward at h=8) runs only in the passes that read a state
    phi = 2 * 128
    assert model_flops_per_token(1000, 2, 8, 16, 1, "all", 128) == 3 * forward  # the ordinary first pass
    assert model_flops_per_token(1000, 2, 8, 16, 3, "all", 128) == 9 * forward + 3 * 2 * phi
    assert model_flops_per_token(1000, 2, 8, 16, 3, "last", 128) == 5 * forward + 2 * phi + 2 * phi
    assert model_flops_per_token(1000, 2, 8, 16, 1, "all", 128, fused_first_pass=True) == 3 * (forward + phi)
    with pytest.raises(ValueError, match="grad_mode"):
        step_forwards(2, "some")


def test_plan_attention_backend_and_scores():
    recipe = load_recipe(RECIPE)
    packed = plan(recipe, 64, "h100", 0.4)
    assert packed.attention == "packed" and packed.fits
    no_te = plan(recipe, 64, "h100", 0.4, te=False)  # local layers, torch SDPA: no scores stored either
    assert no_te.attention == "sdpa" and no_te.memory.activations == packed.memory.activations

    # sequence parallelism keeps the packed path (the 13B recipe's layout): no scores
    sp = plan(load_recipe(RECIPE, ["parallel.tensor=2", "parallel.sequence_parallel=true"]), 64, "h100", 0.4)
    assert sp.attention == "packed" and sp.fits
    assert sp.memory.activations == plan(load_recipe(RECIPE, ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
                                         64, "h100", 0.4, flash=True).memory.activations

    # fp32 on TE has no flash/fused backend and THD none at all: the dense mask on TE's unfused backend,
    # one layer's scores (4-byte) with selective recompute, every layer's of every kept
    # pass without it
    fp32 = load_recipe(RECIPE, ["parallel.tensor=2", "parallel.sequence_parallel=true", "precision=fp32",
                                "model.recompute=selective"])
    flash_fp32 = plan(fp32, 64, "h100", 0.4, flash=True)
    unfused = plan(fp32, 64, "h100", 0.4)
    assert unfused.attention == "unfused"
    assert unfused.memory.activations - flash_fp32.memory.activations == pytest.approx(2 * SCORES / 2)  # TP=2
    full = load_recipe(RECIPE, ["parallel.tensor=2", "parallel.sequence_parallel=true", "model.recompute=none",
                                "precision=fp32"])
    kept = plan(full, 64, "h100", 0.4)
    flash_kept = plan(full, 64, "h100", 0.4, flash=True)
    assert kept.memory.activations - flash_kept.memory.activations == pytest.approx(22 * 3 * 2 * SCORES / 2)
    assert not kept.fits and flash_kept.fits
    assert any("does not fit because attention runs unfused" in w and "bf16" in w for w in kept.warnings)
    assert not kept.phases[1]["fits"] and kept.phases[1]["memory"].total == pytest.approx(kept.memory.total)


def test_gelu_on_gpu_is_exact(single_process):
    """Megatron's MLP under the GPU switches computes exact (erf) GELU, as the HF export and CPU
    generation do (Megatron's fused bias-GELU is the tanh approximation)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.mlp import MLP

    from fbt_megatron.model.fbt_gpt import transformer_config
    from fbt_megatron.model.kernels import fused_switches
    from tests.support.model_helpers import tiny_model_config

    config = transformer_config(tiny_model_config())  # GELU with biases
    gpu = fused_switches("LayerNorm", on_gpu=True, available=lambda name: False, activation="gelu")
    config = dataclasses.replace(config, **gpu)
    torch.manual_seed(0)
    mlp_spec = get_gpt_layer_local_spec().submodules.mlp  # megatron-core 0.19: a partial holding the submodules
    mlp = MLP(config, mlp_spec.keywords["submodules"] if isinstance(mlp_spec, functools.partial) else mlp_spec.submodules)
    x = 40 * torch.randn(5, 2, 32)  # fc1's outputs spread over [-10, 10], where tanh-GELU is off by up to 5e-4
    out, bias = mlp(x)
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    inner = x @ fc1.weight.t() + fc1.bias
    assert inner.abs().max() > 3
    exact = 0.5 * inner * (1 + torch.erf(inner / math.sqrt(2)))  # GELU's definition
    ref = exact @ fc2.weight.t()
    torch.testing.assert_close(out if bias is None else out + bias, ref + (fc2.bias if bias is None else bias),
                               rtol=0, atol=2e-6)
