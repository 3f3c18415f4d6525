"""Checkpoints written before ``feedback.first_input`` existed (their saved recipe has no such field)
were trained with the ``state`` rule: they resume, generate and export under it; a recipe that asks
for the other rule is refused naming both, and nothing is written. And before the switch to
multi-pass batches an FBT run IS a standard run: same losses, bit for bit."""

import json

import pytest
import torch

from tests.support.distributed import DistributedTestFailure, run_distributed
from tests.support.training import losses, tiny_recipe, train_fn

SECTIONS = dict(train={"steps": 8}, schedule={"feedback_start_step": 2, "mix": [0.2, 0.5, 0.3], "seed": 3},
                checkpoint={"every": 1000, "at_end": True})


def _strip_first_input(run_dir):
    """Make the run's checkpoints look like ones written before the field existed."""
    for state_file in run_dir.glob("checkpoints/step_*/state.json"):
        state = json.loads(state_file.read_text())
        del state["recipe"]["feedback"]["first_input"]
        state_file.write_text(json.dumps(state))


def _snapshot(run_dir):
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def legacy_run(tmp_path_factory):
    """A state-rule run stopped at step 4 with its rule stripped from the checkpoint, and the straight
    8-step state-rule run to compare with."""
    root = tmp_path_factory.mktemp("legacy")
    state_rule = {"first_input": "state", "jitter_std": 0.02}
    straight = run_distributed(train_fn, 1, tiny_recipe(root / "straight", **SECTIONS, feedback=state_rule))[0]
    first = tiny_recipe(root / "old", **SECTIONS, feedback=state_rule)
    first["train"]["stop_at_step"] = 4
    run_distributed(train_fn, 1, first)
    _strip_first_input(root / "old")
    return root, straight


def test_old_checkpoint_refuses_the_other_rule_and_writes_nothing(legacy_run):
    root, _ = legacy_run
    before = _snapshot(root / "old")
    asked = tiny_recipe(root / "old", **SECTIONS, feedback={"first_input": "embedding", "jitter_std": 0.02})
    with pytest.raises(DistributedTestFailure, match=r"(?s)PlanError: .* trained with feedback.first_input='state', this recipe asks for "
                                          r"'embedding'"):
        run_distributed(train_fn, 1, asked)
    assert _snapshot(root / "old") == before


def test_old_checkpoint_resumes_under_its_rule(legacy_run, tmp_path):
    """A recipe that does not set the rule resumes the old checkpoint under 'state': the trajectory is
    the straight state-rule run's."""
    import shutil

    root, straight = legacy_run
    shutil.copytree(root / "old", tmp_path / "old")
    resumed = run_distributed(train_fn, 1, tiny_recipe(tmp_path / "old", **SECTIONS))[0]  # no first_input
    assert resumed["history"][0][0] == 4 and resumed["step"] == 8
    assert max(abs(a - b) for a, b in zip(losses(resumed), losses(straight)[4:])) < 1e-6
    latest = (tmp_path / "old" / "checkpoints" / "latest").read_text().strip()
    saved = json.loads((tmp_path / "old" / "checkpoints" / latest / "state.json").read_text())
    assert saved["recipe"]["feedback"]["first_input"] == "state"


def test_old_checkpoint_generates_and_exports_under_its_rule(legacy_run, tmp_path, single_process):
    from fbt_megatron.generate.decoder import FeedbackDecoder
    from fbt_megatron.generate.loading import load_for_inference
    from fbt_megatron.hf.export import export_checkpoint
    from fbt_megatron.hf.mapping import ConversionError
    from fbt_megatron.model.sequential import sequential_forward

    root, _ = legacy_run
    model = load_for_inference(root / "old", need_tokenizer=False).model
    assert model.feedback_config.first_input == "state"
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    _, every = FeedbackDecoder(model, "feedback", "exact").session([ids[0].tolist()], 1).prefill(return_all=True)
    torch.testing.assert_close(every[0], sequential_forward(model, ids).logits[0], rtol=1e-5, atol=1e-5)
    export_checkpoint(root / "old", tmp_path / "hf", log=lambda *a: None)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["feedback_first_input"] == "state"
    with pytest.raises(ConversionError, match=r"feedback.first_input='state'"):
        export_checkpoint(root / "old", tmp_path / "std", standard=True, log=lambda *a: None)


def test_before_the_switch_fbt_trains_exactly_like_a_standard_gpt(tmp_path):
    """Same seed, same data: an FBT run's losses before its first multi-pass batch equal a fusion-off
    run's, bit for bit (the fusion neither enters pass 1 nor moves the other weights)."""
    sections = dict(SECTIONS, schedule={"feedback_start_step": 5, "mix": [0.2, 0.5, 0.3], "seed": 3},
                    train={"steps": 7})
    fbt = run_distributed(train_fn, 1, tiny_recipe(tmp_path / "fbt", **sections))[0]
    plain = run_distributed(train_fn, 1, tiny_recipe(tmp_path / "plain", **sections, feedback={"fusion": "off"}))[0]
    assert [h[1] for h in fbt["history"]][:5] == [1] * 5 and max(h[1] for h in fbt["history"][5:]) > 1
    assert losses(fbt)[:5] == losses(plain)[:5]
    assert losses(fbt)[5:] != losses(plain)[5:]  # and the feedback steps are different steps


def test_a_checkpoint_keeps_its_stabilisers_on_resume(tmp_path):
    """A run trained with the bounded mixin, another mixin weight and jitter resumes under a recipe
    that sets none of them (whose defaults differ) with the checkpoint's: the trajectory is the straight
    run's; a recipe that asks for another mixin is refused naming both, and nothing is written."""
    stabilisers = {"mixin": "bounded", "prefix_mixin": 0.3, "jitter_std": 0.05}
    straight = run_distributed(train_fn, 1, tiny_recipe(tmp_path / "straight", **SECTIONS, feedback=stabilisers))[0]
    first = tiny_recipe(tmp_path / "run", **SECTIONS, feedback=stabilisers)
    first["train"]["stop_at_step"] = 4
    run_distributed(train_fn, 1, first)
    plain = tiny_recipe(tmp_path / "run", **SECTIONS)
    plain["feedback"] = {}  # every stabiliser at its default
    before = _snapshot(tmp_path / "run")
    asked = tiny_recipe(tmp_path / "run", **SECTIONS, feedback={"mixin": "affine"})
    with pytest.raises(DistributedTestFailure, match=r"trained with feedback.mixin='bounded', this recipe asks for "
                                                     r"'affine'"):
        run_distributed(train_fn, 1, asked)
    assert _snapshot(tmp_path / "run") == before
    resumed = run_distributed(train_fn, 1, plain)[0]
    assert resumed["history"][0][0] == 4 and resumed["step"] == 8
    assert max(abs(a - b) for a, b in zip(losses(resumed), losses(straight)[4:])) < 1e-6
