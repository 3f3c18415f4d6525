"""The engine replaces two DeepSpeed methods for correctness (fbt_megatron/engine/patches.py). They were
written against DeepSpeed's internals of the versions in ``PATCHED_DEEPSPEED``: this test fails on any other
version, so an upgrade re-checks both (the behaviour itself is tested by test_train_nonfinite.py, ZeRO 0-3,
and the TP/PP gradient-norm tests). The CPU shortcuts inside ZeRO-1/2 are test_cpu_fastpaths.py's."""

from __future__ import annotations

import inspect


def _deepspeed():
    from fbt_megatron.engine import import_deepspeed

    return import_deepspeed()


def test_deepspeed_is_a_version_the_patches_were_checked_against():
    from fbt_megatron.engine.patches import PATCHED_DEEPSPEED, deepspeed_version

    ds = _deepspeed()
    assert deepspeed_version() in PATCHED_DEEPSPEED, (
        f"DeepSpeed {ds.__version__}: the engine's patches (SkippableStep, replace_zero0_clipping) were "
        f"checked against {PATCHED_DEEPSPEED} only; re-check them and add the version to PATCHED_DEEPSPEED")


def test_the_patched_methods_are_where_the_patches_expect_them():
    _deepspeed()
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    # 2. ZeRO-0 clipping: the engine's model step calls clip_fp32_gradients(), then the optimiser's step
    step_src = inspect.getsource(DeepSpeedEngine._take_model_step)
    assert hasattr(DeepSpeedEngine, "clip_fp32_gradients") and "self.clip_fp32_gradients()" in step_src
    # 1. SkippableStep: every DeepSpeed optimiser reaches the inner torch optimiser through its step()
    assert "self.optimizer.step()" in step_src
    assert "self.optimizer.step()" in inspect.getsource(DeepSpeedZeroOptimizer._optimizer_step)
    assert "optimizer.step()" in inspect.getsource(DeepSpeedZeroOptimizer_Stage3._optimizer_step)
