"""2 processes with ZeRO-1/2/3 and with TP=2 follow the single-process loss trajectory (1e-5),
over steps that include feedback passes."""

import pytest

from fbt_megatron.testing.distributed import run_distributed
from fbt_megatron.train.testing import losses, tiny_recipe, train_fn

TOL = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = run_distributed(train_fn, 1, tiny_recipe(tmp_path_factory.mktemp("ref")))[0]
    passes = [h[1] for h in out["history"]]
    assert len(passes) >= 5 and max(passes) > 1, f"the run must contain feedback steps: {passes}"
    return out


@pytest.mark.parametrize("parallel", [
    {"zero_stage": 1}, {"zero_stage": 2}, {"zero_stage": 3}, {"tensor": 2, "zero_stage": 1},
], ids=["dp2-zero1", "dp2-zero2", "dp2-zero3", "tp2"])
def test_two_processes_follow_single_process(reference, parallel, tmp_path):
    out = run_distributed(train_fn, 2, tiny_recipe(tmp_path, parallel=parallel))
    ref = losses(reference)
    for rank_summary in out:
        got = losses(rank_summary)
        assert len(got) == len(ref)
        diffs = [abs(a - b) for a, b in zip(ref, got)]
        assert max(diffs) < TOL, f"{parallel}: per-step |diff| {diffs}"
        assert [h[1] for h in rank_summary["history"]] == [h[1] for h in reference["history"]]
        assert [h[4] for h in rank_summary["history"]] == [h[4] for h in reference["history"]]  # same samples
