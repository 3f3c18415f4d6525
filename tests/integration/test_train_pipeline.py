"""Training at PP=2 follows the PP=1 trajectory (loss and gradient norm per step, over the switch to
feedback passes), with ZeRO data parallelism (PP=2 x DP=2), resumes across PP=2 <-> PP=1, and skips
non-finite steps as PP=1 does."""

import math

import pytest

from tests.support.distributed import run_distributed
from tests.support.training import losses, tiny_recipe, train_fn

TOL = 1e-5
# 4 layers (2 per stage), feedback from step 2, 4 micro-batches per step at DP=1.
SECTIONS = dict(model={"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 128,
                       "max_sequence_length": 16},
                data={"seq_length": 16, "synthetic": {"vocab_size": 128}, "valid_sequences": 8},
                train={"steps": 6}, eval={"every": 1000, "at_end": True},
                checkpoint={"every": 1000, "at_end": True, "keep_last": 2})


def recipe(run_dir, **parallel):
    r = tiny_recipe(run_dir, **SECTIONS)
    r["parallel"].update(parallel)
    return r


def grad_norms(summary):
    return [h[5] for h in summary["history"]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = run_distributed(train_fn, 1, recipe(tmp_path_factory.mktemp("pp1")))[0]
    passes = [h[1] for h in out["history"]]
    assert passes[:2] == [1, 1] and max(passes) > 1, f"the run must cross the feedback switch: {passes}"
    return out


def assert_follows(reference, summary, steps=None):
    ref = reference["history"][slice(*steps) if steps else slice(None)]
    got = summary["history"]
    assert [h[1] for h in got] == [h[1] for h in ref]  # same pass counts
    assert [h[4] for h in got] == [h[4] for h in ref]  # same samples
    diffs = [abs(a[2] - b[2]) for a, b in zip(got, ref)]
    assert max(diffs) < TOL, f"per-step loss |diff| {diffs}"
    norms = [abs(a[5] - b[5]) for a, b in zip(got, ref)]
    assert max(norms) < TOL, f"per-step grad-norm |diff| {norms}"


@pytest.mark.parametrize("world,parallel", [
    (2, {"pipeline": 2, "zero_stage": 1}),
    (4, {"pipeline": 2, "zero_stage": 2}),  # PP=2 x DP=2
], ids=["pp2-zero1", "pp2-dp2-zero2"])
def test_pipeline_follows_single_process(reference, tmp_path, world, parallel):
    r = recipe(tmp_path, **parallel)
    r["checkpoint"]["at_end"] = False  # not needed here (resumes are tested below)
    out = run_distributed(train_fn, world, r)
    for summary in out:
        assert_follows(reference, summary)
        assert summary["val_loss_1pass"] == pytest.approx(reference["val_loss_1pass"], abs=TOL)


@pytest.mark.parametrize("first,second", [
    ((2, {"pipeline": 2, "zero_stage": 1}), (1, {"zero_stage": 0})),
    ((1, {"zero_stage": 0}), (2, {"pipeline": 2, "zero_stage": 0})),
], ids=["pp2-to-pp1", "pp1-to-pp2"])
def test_resume_across_pipeline_layouts(reference, tmp_path, first, second):
    a = recipe(tmp_path, **first[1])
    a["train"]["stop_at_step"] = 3
    out_a = run_distributed(train_fn, first[0], a)[0]
    assert out_a["step"] == 3 and out_a["checkpoint"]
    out_b = run_distributed(train_fn, second[0], recipe(tmp_path, **second[1]))[0]
    assert out_b["history"][0][0] == 3 and out_b["step"] == 6
    assert_follows(reference, out_a, (0, 3))
    assert_follows(reference, out_b, (3, 6))


FAULTS = {1: "grad:nan", 3: "loss:inf", 4: "reported:nan"}


def test_nonfinite_steps_are_skipped_alike_at_pp1_and_pp2(tmp_path):
    """One runner interface: a non-finite gradient, a non-finite loss and a non-finite reported loss skip the
    same steps at PP=2 as at PP=1 (the faults reach both runners the same way), and the finite steps around
    them follow the same trajectory."""
    def run(world, name, **parallel):
        r = recipe(tmp_path / name, **parallel)
        r["checkpoint"]["at_end"] = False
        return run_distributed(train_fn, world, r, FAULTS)[0]

    pp1, pp2 = run(1, "pp1", zero_stage=0), run(2, "pp2", pipeline=2, zero_stage=1)
    for out in (pp1, pp2):
        assert [h[3] for h in out["history"]] == [False, True, False, True, True, False]
        assert out["skipped_steps"] == 3
    assert [h[1] for h in pp2["history"]] == [h[1] for h in pp1["history"]]
    for (step, _, a, _, _, ga), (_, _, b, _, _, gb) in zip(pp1["history"], pp2["history"]):
        for x, y, what in ((a, b, "loss"), (ga, gb, "grad norm")):
            assert math.isfinite(x) == math.isfinite(y), f"step {step}: {what} {x} (PP=1) vs {y} (PP=2)"
            if math.isfinite(x):
                assert abs(x - y) < TOL, f"step {step}: {what} {x} (PP=1) vs {y} (PP=2)"


def test_a_model_without_fusion_trains_past_the_switch_at_pp2(tmp_path):
    """A standard model (``feedback.fusion=off``) at PP=2 runs one pass every step past the switch (the
    pipeline schedule refuses more passes without a fusion) and follows its PP=1 run."""
    def off(run_dir, **parallel):
        r = recipe(run_dir, **parallel)
        r["feedback"] = {"fusion": "off"}
        r["checkpoint"]["at_end"] = False
        return r

    one = run_distributed(train_fn, 1, off(tmp_path / "pp1"))[0]
    assert [h[1] for h in one["history"]] == [1] * 6
    for summary in run_distributed(train_fn, 2, off(tmp_path / "pp2", pipeline=2, zero_stage=1)):
        assert_follows(one, summary)
