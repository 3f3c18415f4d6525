"""A non-finite gradient with a finite loss (nan and inf), and a non-finite loss, skip the step at
every ZeRO stage: weights, both AdamW moments and Adam's step count are untouched. The same runs check
the AdamW parameter groups at every stage: a step on an all-zero gradient from zero moments is pure
weight decay, so it must scale exactly the decayed parameters and leave norms, biases, h_init and
(by default) the embeddings as they were."""

import math

import pytest
import torch

from fbt_megatron.engine import no_weight_decay
from fbt_megatron.train.lr_schedule import lr_at
from tests.support.distributed import run_distributed
from tests.support.training import grad_norms, losses, tiny_recipe, train_fn

FAULTS = {0: "grad:zero", 2: "grad:nan", 3: "grad:inf", 4: "loss:inf"}
WEIGHT_DECAY = 0.5


def same_state(a: dict, b: dict, what: str) -> None:
    assert a["adam_step"] == b["adam_step"], f"{what}: Adam step {a['adam_step']} -> {b['adam_step']}"
    for key in ("params", "exp_avg", "exp_avg_sq"):
        for name, value in a[key].items():
            assert torch.equal(value, b[key][name]), f"{what}: {key} of {name} changed"


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_nonfinite_gradient_and_loss_skip_the_step(tmp_path, zero_stage):
    recipe = tiny_recipe(tmp_path, parallel={"zero_stage": zero_stage}, train={"steps": 6},
                         optimizer={"lr": 3e-3, "weight_decay": WEIGHT_DECAY, "grad_clip": 1.0})
    summary = run_distributed(train_fn, 2, recipe, FAULTS, None, None, "step_states")[0]
    states, history = summary["probe"], summary["history"]
    assert [h[3] for h in history] == [False, False, True, True, True, False]
    assert summary["skipped_steps"] == 3 and summary["stop_reason"] is None
    assert math.isfinite(losses(summary)[2]) and math.isfinite(losses(summary)[3])  # only the gradient was bad
    assert not math.isfinite(grad_norms(summary)[2]) and not math.isfinite(grad_norms(summary)[3])
    for step, fault in ((2, "nan gradient"), (3, "inf gradient"), (4, "inf loss")):
        same_state(states[step - 1], states[step], f"ZeRO-{zero_stage} step {step} ({fault})")
    # The step after the skips is applied and finite.
    after = states[5]
    assert after["adam_step"] == states[4]["adam_step"] + 1 == 3
    assert all(torch.isfinite(v).all() for v in after["params"].values())
    assert not torch.equal(after["params"]["feedback.value.weight"], states[4]["params"]["feedback.value.weight"])

    # Step 0 had an all-zero gradient: AdamW's update is then weight decay alone.
    lr0 = lr_at(0, kind="cosine", lr=3e-3, total_steps=6, warmup_steps=2, min_lr_ratio=0.1)
    before, decayed_step = states["initial"]["params"], states[0]["params"]
    decayed, plain = [], []
    fusion = ("feedback.value.weight", "feedback.gate.weight")  # decayed from the feedback start (step 2) only
    for name, value in before.items():
        if no_weight_decay(name, value, decay_embeddings=False) or name in fusion:
            plain.append(name)
            assert torch.equal(decayed_step[name], value), f"ZeRO-{zero_stage}: {name} was decayed"
        else:
            decayed.append(name)
            torch.testing.assert_close(decayed_step[name], value * (1 - lr0 * WEIGHT_DECAY), rtol=1e-6, atol=0)
    assert "feedback.initial_state" in plain and "gpt.embedding.word_embeddings.weight" in plain
    assert any("layernorm" in n for n in plain) and "feedback.value.weight" in plain
    assert any("linear_qkv.weight" in n for n in decayed)


def test_a_nonfinite_loss_alone_skips_the_step(tmp_path):
    """The loss check by itself (the injected "loss:*" faults make the gradient non-finite as well, so the
    gradient-norm check would skip those steps anyway): a NaN loss after a finite backward skips the step,
    with weights, moments and Adam's step count untouched (DP=1, ZeRO-0; the check is stage-independent)."""
    recipe = tiny_recipe(tmp_path, train={"steps": 3})
    summary = run_distributed(train_fn, 1, recipe, {1: "reported:nan"}, None, None, "step_states")[0]
    states, history = summary["probe"], summary["history"]
    assert [h[3] for h in history] == [False, True, False] and summary["skipped_steps"] == 1
    assert not math.isfinite(losses(summary)[1]) and math.isfinite(grad_norms(summary)[1])  # the gradient was fine
    same_state(states[0], states[1], "step 1 (NaN loss, finite gradient)")
    assert states[2]["adam_step"] == states[1]["adam_step"] + 1


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_a_bf16_run_whose_steps_are_all_skipped_changes_nothing(tmp_path, zero_stage):
    """Every step skipped (a NaN loss, a NaN gradient, an inf gradient, a NaN loss after a finite backward):
    each rank's model parameters, fp32 masters (its ZeRO partitions), AdamW moments and step count are
    bitwise what they were before training, in bf16 (DeepSpeed's bf16 optimisers; fp32: the test above);
    the weight decay of a skipped step is skipped too."""
    recipe = tiny_recipe(tmp_path, parallel={"zero_stage": zero_stage}, train={"steps": 4, "max_nonfinite_in_row": 10},
                         optimizer={"lr": 3e-3, "weight_decay": WEIGHT_DECAY, "grad_clip": 1.0})
    faults = {0: "loss:nan", 1: "grad:nan", 2: "grad:inf", 3: "reported:nan"}
    for rank, summary in enumerate(run_distributed(train_fn, 2, recipe, faults, {"FBT_DTYPE": "bf16"}, None,
                                                   "unchanged_state")):
        probe = summary["probe"]
        assert summary["skipped_steps"] == 4 and [h[3] for h in summary["history"]] == [True] * 4
        assert probe["param_dtype"] == "torch.bfloat16", probe
        assert any(k.endswith("/exp_avg_sq") for k in probe["compared"]) and any(k.startswith("model/") for k in
                                                                                    probe["compared"])
        assert probe["changed"] == [], (f"rank {rank}, ZeRO-{zero_stage} bf16 ({probe['optimizer']}): {len(probe['changed'])} tensors changed, "
                                   f"e.g. {probe['changed'][:4]}")
