"""AdamW's parameter groups (``fbt_megatron/engine/param_groups.py``): the fusion's own group."""

from fbt_megatron.model.fbt_gpt import build_model
from tests.support.model_helpers import feedback, tiny_model_config


def test_the_fusion_matrices_form_the_optimisers_fusion_group(single_process):
    """W_U and W_G, and no other parameter, go to AdamW's fusion group (engine/param_groups.py): undecayed
    until the first step that may run feedback (a 1-pass step leaves them out of the forward, so decay alone
    would shrink them unused) and stepped at fusion_lr_multiplier. Their biases are vectors: never decayed."""
    from fbt_megatron.engine.param_groups import param_groups

    for bias in (False, True):
        fb_model = build_model(tiny_model_config(), feedback(bias=bias))
        groups = {g["group"]: g for g in param_groups(fb_model, 0.1, False, fusion_decay_from=50,
                                                         fusion_lr_multiplier=10.0)}
        fusion = groups["fusion"]
        assert {id(p) for p in fusion["params"]} == {id(fb_model.feedback.value.weight),
                                                     id(fb_model.feedback.gate.weight)}, bias
        assert (fusion["weight_decay"], fusion["decay_from_step"], fusion["lr_multiplier"]) == (0.0, 50, 10.0)
        decayed = {id(p) for p in groups["decay"]["params"]}
        assert decayed and not decayed & {id(p) for p in fb_model.feedback.parameters()}, bias
