"""The engine replaces four DeepSpeed methods (fbt_megatron/engine/patches.py). They were written against
DeepSpeed's internals of the versions in ``PATCHED_DEEPSPEED``: this test fails on any other version, so
an upgrade re-checks all four (the behaviour itself is tested by test_train_nonfinite.py, ZeRO 0-3, and the
TP/PP gradient-norm tests; the one-rank reduction by test_engine_step.py)."""

from __future__ import annotations

import inspect


def _deepspeed():
    from fbt_megatron.engine import import_deepspeed

    return import_deepspeed()


def test_deepspeed_is_a_version_the_patches_were_checked_against():
    from fbt_megatron.engine.patches import PATCHED_DEEPSPEED, deepspeed_version

    ds = _deepspeed()
    assert deepspeed_version() in PATCHED_DEEPSPEED, (
        f"DeepSpeed {ds.__version__}: the engine's patches (SkippableStep, replace_zero0_clipping, "
        f"skip_one_rank_all_reduce, keep_flat_grad_partition) were checked "
        f"against {PATCHED_DEEPSPEED} only; re-check them and add the version to PATCHED_DEEPSPEED")


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
    # 3. the one-rank reduction: a bucket is flattened, divided by the group's size, all-reduced and copied
    # back (cast through the communication dtype), with its share added to the gradient-partition buffer
    copy_src = inspect.getsource(DeepSpeedZeroOptimizer.allreduce_and_copy)
    assert "self.allreduce_bucket(" in copy_src and "self._add_to_grad_partition_buffer(output, synced)" in copy_src
    assert "buf.copy_(synced)" in copy_src
    bucket_src = inspect.getsource(DeepSpeedZeroOptimizer.allreduce_bucket)
    assert "tensor = self.flatten(bucket)" in bucket_src and "dist.all_reduce(tensor_to_allreduce" in bucket_src
    assert "tensor_to_allreduce.div_(dist.get_world_size(group=process_group)" in bucket_src
    # 4. the kept flat gradient partition: the step flattens averaged_gradients[i] itself (the last rank
    # aligned to the partition size, the others plainly), hands the result to the inner optimiser as the
    # fp32 partition's .grad and drops it after that group's update
    zero_step_src = inspect.getsource(DeepSpeedZeroOptimizer.step)
    assert "self.flatten_dense_tensors_aligned(self.averaged_gradients[i]," in zero_step_src
    assert "self.flatten(self.averaged_gradients[i])" in zero_step_src
    update = zero_step_src.index("self._optimizer_step(i)", zero_step_src.index("flat_grad_partition = self.flatten"))
    assert zero_step_src.index("self.single_partition_of_fp32_groups[i].grad = None", update) > update
    assert list(inspect.signature(DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned).parameters) == [
        "self", "tensor_list", "alignment", "use_cpu_data", "param_padding"]  # the wrapper's arguments
    aligned_src = inspect.getsource(DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned)
    assert "return self.flatten(align_dense_tensors(tensor_list, alignment))" in aligned_src
