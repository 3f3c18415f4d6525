"""bf16 training (DeepSpeed's bf16 path, forced on CPU with FBT_DTYPE=bf16): checkpoints hold the fp32 master
weights, not the bf16 copies, and a resume restores them exactly; a ZeRO-1 bf16 checkpoint also resumes
under ZeRO-0 bf16 (DeepSpeed's FP16_UnfusedOptimizer, whose fp32 copies are separate tensors)."""

import shutil

import pytest
import torch

from fbt_megatron.checkpoint.manager import read_full_tensors
from tests.support.distributed import run_distributed
from tests.support.training import tiny_recipe, train_fn

BF16 = {"FBT_DTYPE": "bf16"}
SECTIONS = dict(train={"steps": 6}, schedule={"feedback_start_step": 3, "mix": [0.2, 0.5, 0.3], "seed": 3},
                checkpoint={"every": 1000, "at_end": True}, parallel={"zero_stage": 1})


def _dp2_runs(base: str) -> dict:
    import torch.distributed as dist

    straight = train_fn(tiny_recipe(f"{base}/straight", **SECTIONS), env=BF16)
    first = tiny_recipe(f"{base}/save", **SECTIONS)
    first["train"]["stop_at_step"] = 3
    saved = train_fn(first, env=BF16)
    if dist.get_rank() == 0:
        shutil.copytree(f"{base}/save", f"{base}/resume")
    dist.barrier()
    resumed = train_fn(tiny_recipe(f"{base}/resume", **SECTIONS), env=BF16)
    return {"straight": straight, "saved": saved, "resumed": resumed}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("bf16")
    out = run_distributed(_dp2_runs, 2, str(base))[0]
    shutil.copytree(base / "save", base / "zero0")
    out["zero0"] = run_distributed(train_fn, 1, tiny_recipe(base / "zero0", **dict(SECTIONS, parallel={"zero_stage": 0})),
                                   None, BF16)[0]
    return base, out


def test_bf16_resume_restores_fp32_masters_exactly(runs):
    base, out = runs
    ref, got = out["straight"]["history"][3:], out["resumed"]["history"]
    assert [h[4] for h in got] == [h[4] for h in ref]
    assert max(abs(a[2] - b[2]) for a, b in zip(got, ref)) < 1e-5
    assert max(abs(a[5] - b[5]) for a, b in zip(got, ref)) < 1e-5
    final = read_full_tensors(base / "resume" / "checkpoints" / "step_00000006")
    want = read_full_tensors(base / "straight" / "checkpoints" / "step_00000006")
    for key in want:
        assert torch.equal(final[key], want[key]), key


def test_bf16_checkpoint_holds_fp32_masters_not_bf16_copies(runs):
    base, _ = runs
    saved = read_full_tensors(base / "save" / "checkpoints" / "step_00000003")
    weights = {k: v for k, v in saved.items() if not k.startswith("optimizer.")}
    assert all(v.dtype == torch.float32 for v in saved.values())
    # bf16 copies would round-trip through bf16 unchanged; trained fp32 masters do not.
    changed = sum(int((v != v.bfloat16().float()).sum()) for v in weights.values())
    assert changed > 0.5 * sum(v.numel() for v in weights.values())


def test_bf16_zero1_checkpoint_resumes_under_zero0(runs):
    """Every resumed step (loss, gradient norm) and the final fp32 masters follow the straight ZeRO-1 run.
    ZeRO-0 bf16 accumulates gradients in bf16 (ZeRO-1 in fp32): close, not bit-equal. Measured (2026-11-30):
    losses within 7e-5, gradient norms within 0.07 %, masters within 1.8 % of a tensor's norm. A resume
    that trains on other bf16 weights than the loaded masters is off by 0.04 in loss, 100 % in gradient norm
    and 40 % in the masters."""
    base, out = runs
    ref, got = out["straight"]["history"][3:], out["zero0"]["history"]
    assert [h[0] for h in got] == [3, 4, 5] and [h[4] for h in got] == [h[4] for h in ref]
    for a, b in zip(got, ref):
        assert abs(a[2] - b[2]) < 1e-3, ("loss", got, ref)
        assert abs(a[5] - b[5]) < 1e-2 * b[5], ("grad norm", got, ref)
    final = read_full_tensors(base / "zero0" / "checkpoints" / "step_00000006")
    want = read_full_tensors(base / "straight" / "checkpoints" / "step_00000006")
    assert sorted(final) == sorted(want)
    for key in (k for k in want if not k.startswith("optimizer.")):
        rel = float((final[key] - want[key]).norm() / want[key].norm())
        assert rel < 0.06, (key, rel)
