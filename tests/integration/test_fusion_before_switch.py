"""The fusion's weights (W_U, W_G) before the first multi-pass step, in every optimiser layout.

Under the ordinary first pass the fusion takes no part in a 1-pass step, so its gradient is zero:
DeepSpeed hands the optimiser zero-filled gradients for it in every layout tested here. Before this was
fixed, AdamW's decoupled weight decay therefore shrank W_U and W_G throughout the single-pass phase. The
rule now: the fusion decays only from the first step that may run feedback
(``schedule.feedback_start_step``); the layouts agree before and after the switch.
"""

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.training import tiny_recipe, train_fn

FUSION = ("feedback.value.weight", "feedback.gate.weight")
START = 3  # feedback_start_step: steps 0, 1, 2 are single-pass
LAYOUTS = {  # name: (processes, recipe sections)
    "zero0": (1, {}),
    "zero1": (1, {"parallel": {"zero_stage": 1}}),
    # the fusion lives on stage 0 only; every stage must still hand ZeRO the same number of groups
    "pp2-zero1": (2, {"parallel": {"zero_stage": 1, "pipeline": 2}}),
}


def _run(tmp_path, name):
    world, sections = LAYOUTS[name]
    recipe = tiny_recipe(tmp_path / name, schedule={"feedback_start_step": START, "mix": [0.0, 1.0], "seed": 3},
                         optimizer={"lr": 3e-3, "grad_clip": 1.0, "weight_decay": 0.5},
                         train={"steps": START + 2}, **sections)
    return run_distributed(train_fn, world, recipe, None, None, None, "step_states", timeout=300)[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("switch")
    return {name: _run(tmp, name) for name in LAYOUTS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fusion_is_untouched_until_the_switch(runs, layout):
    states = runs[layout]["probe"]
    assert [h[1] for h in runs[layout]["history"]] == [1] * START + [2, 2]  # the pass counts the test assumes
    for name in FUSION:
        initial = states["initial"]["params"][name]
        for step in range(START):
            assert torch.equal(states[step]["params"][name], initial), f"{layout}: {name} moved at 1-pass step {step}"
        assert not torch.equal(states[START]["params"][name], initial), f"{layout}: {name} not trained at the switch"
    # the rest of the model trains (weight decay included) from step 0
    other = "gpt.decoder.layers.0.mlp.linear_fc1.weight"
    assert not torch.equal(states[0]["params"][other], states["initial"]["params"][other])


def test_layouts_agree_across_the_switch(runs):
    """Same Adam step count for every parameter, and the same weights after the first 2-pass steps, at
    ZeRO-0 and ZeRO-1 (one process: only the optimiser's layout differs)."""
    a, b = runs["zero0"]["probe"], runs["zero1"]["probe"]
    last = START + 1
    for step in range(last + 1):
        assert a[step]["adam_step"] == b[step]["adam_step"] == step + 1
    # fp32 sums in another order move an element whose gradient is near zero by a fraction of one Adam
    # step (measured: <= 3.3e-5 x the tensor's largest value, before the switch too); an uncounted
    # Adam step (bias correction) or a decay would move the fusion by ~lr (3e-3) per step.
    for name, value in a[last]["params"].items():
        torch.testing.assert_close(b[last]["params"][name], value, rtol=1e-4, atol=1e-4, msg=f"params of {name}")
    for name in FUSION:
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(b[last][key][name], a[last][key][name], rtol=1e-3, atol=1e-9,
                                       msg=f"{key} of {name}")


@pytest.mark.parametrize("sections, start", [
    ({}, START),  # the ordinary first pass: from the first step that may run feedback
    ({"feedback": {"first_input": "state"}}, 0),  # the ablation: the fusion feeds every pass
    ({"schedule": {"feedback_start_step": START, "mix": [1.0]}}, None),  # feedback never runs
    ({"feedback": {"fusion": "off"}}, None),
])
def test_fusion_weight_decay_turns_on_at_the_first_feedback_step(tmp_path, sections, start):
    from types import SimpleNamespace

    from fbt_megatron.engine import Engine, fusion_decay_start
    from fbt_megatron.recipe import load_recipe

    data = tiny_recipe(tmp_path, schedule={"feedback_start_step": START, "mix": [0.0, 1.0], "seed": 3},
                       optimizer={"weight_decay": 0.5})
    for key, value in sections.items():
        data[key].update(value)
    recipe = load_recipe(data=data)
    assert fusion_decay_start(recipe) == start
    if start is None:
        return
    w_u, w_g, other = (torch.nn.Parameter(torch.ones(4, 4)) for _ in range(3))
    w_u.latent_feedback_fusion = w_g.latent_feedback_fusion = True
    model = torch.nn.ParameterDict({"u": w_u, "g": w_g, "o": other})
    from fbt_megatron.engine import param_groups

    opt = torch.optim.AdamW(param_groups(model, 0.5, False, start), lr=1.0)
    engine = SimpleNamespace(torch_optimizer=opt)
    for step in range(START + 2):
        Engine.set_step(engine, step)
        wd = {g["group"]: g["weight_decay"] for g in opt.param_groups}
        assert wd["decay"] == 0.5 and wd["fusion"] == (0.5 if step >= start else 0.0), (step, wd)
        assert [p is w_u or p is w_g for p in opt.param_groups[-1]["params"]] == [True, True]
