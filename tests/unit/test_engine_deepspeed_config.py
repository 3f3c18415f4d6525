"""The DeepSpeed config a recipe gets: where the gradient work overlaps the backward."""

import pytest

from fbt_megatron import runtime
from fbt_megatron.engine.deepspeed_config import REDUCE_BUCKET_ELEMENTS, deepspeed_config
from fbt_megatron.recipe import load_recipe


def config(stage: int, precision: str, gpu: bool, monkeypatch) -> dict:
    monkeypatch.setattr(runtime, "use_cuda", lambda: gpu)
    return deepspeed_config(load_recipe("recipes/tiny.yaml", [f"parallel.zero_stage={stage}",
                                                              f"precision={precision}"]), 1)


@pytest.mark.parametrize("gpu", [False, True])
def test_bf16_zero1_adds_each_gradient_to_fp32_as_backward_makes_it(gpu, monkeypatch):
    """bf16 ZeRO-1 runs DeepSpeed's BF16_Optimizer: ``immediate_grad_update`` adds each bf16 gradient to its
    fp32 accumulator from a backward hook and releases it, on CPU as on GPU (the CPU tests run the GPU's path)."""
    cfg = config(1, "bf16", gpu, monkeypatch)
    assert cfg["bf16"] == {"enabled": True, "check_grad_overflow": True, "immediate_grad_update": True}
    assert cfg["data_types"] == {"grad_accum_dtype": "fp32"}
    for stage in (0, 2, 3):  # no BF16_Optimizer there: the key would do nothing
        assert config(stage, "bf16", gpu, monkeypatch)["bf16"]["immediate_grad_update"] is False
    assert "bf16" not in config(1, "fp32", gpu, monkeypatch)


def test_zero2_on_gpu_overlaps_its_reduction_with_backward(monkeypatch):
    gpu = config(2, "bf16", True, monkeypatch)["zero_optimization"]
    assert gpu == {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                   "reduce_bucket_size": REDUCE_BUCKET_ELEMENTS}
    assert config(2, "bf16", False, monkeypatch)["zero_optimization"] == {"stage": 2, "contiguous_gradients": False}
    assert config(1, "bf16", True, monkeypatch)["zero_optimization"] == {"stage": 1}


def test_deepspeed_accepts_the_configs(monkeypatch):
    """DeepSpeed's own config model reads every key (a misspelt one raises there)."""
    from fbt_megatron.engine import import_deepspeed

    import_deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    for stage, gpu in ((1, True), (2, True), (1, False)):
        cfg = config(stage, "bf16", gpu, monkeypatch)
        ds = DeepSpeedConfig(cfg)
        assert ds.zero_optimization_stage == stage
        if stage == 1:
            assert ds.bfloat16_config.immediate_grad_update is True
        else:
            assert ds.zero_config.overlap_comm is True and ds.zero_config.reduce_bucket_size == REDUCE_BUCKET_ELEMENTS
