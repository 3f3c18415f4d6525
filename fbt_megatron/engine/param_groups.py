"""AdamW parameter groups: which parameters decay, and the fusion group decayed from the feedback start."""

from __future__ import annotations

import torch


def is_embedding(name: str, param: torch.nn.Parameter | None = None) -> bool:
    """Word and (learned) position embeddings, and the last pipeline stage's copy of a tied word
    embedding (megatron marks both copies ``shared_embedding``; the copy is named ``output_layer``)."""
    return ".embedding." in f".{name}" or bool(getattr(param, "shared_embedding", False))


def no_weight_decay(name: str, param: torch.nn.Parameter, decay_embeddings: bool) -> bool:
    """Norm weights/biases, linear biases and h_init are vectors: decaying them pulls norms' gains
    and h_init (the prefix mixin's anchor) toward zero. Embeddings by choice."""
    return param.ndim < 2 or (is_embedding(name, param) and not decay_embeddings)


def is_fusion(param: torch.nn.Parameter) -> bool:
    """W_U and W_G of the latent-feedback fusion (marked by ``model/feedback.py``)."""
    return bool(getattr(param, "latent_feedback_fusion", False))


def fusion_decay_start(recipe) -> int | None:
    """The first step at which the fusion's weights decay: the first step that may run feedback.

    Under the ordinary first pass a 1-pass step leaves the fusion out of the forward, so its gradient
    is zero (DeepSpeed zero-fills a missing one in every layout); decaying it anyway would shrink
    W_U and W_G towards zero before they are ever used, undoing their initialisation over a long
    single-pass phase (at lr 3e-4, wd 0.1: to 5 % of it in 100k steps). None: the fusion never runs."""
    fb, schedule = recipe.feedback, recipe.schedule
    if fb.fusion == "off":
        return None
    if fb.fused_first_pass:
        return 0  # the fusion feeds every pass
    if not any(p > 0 for p in schedule.mix[1:]):
        return None
    return schedule.feedback_start_step


def fusion_weight_decay(weight_decay: float, decay_from: int | None, step: int) -> float:
    """The fusion group's weight decay at ``step``: ``weight_decay`` from ``decay_from`` on (None: never)."""
    return weight_decay if decay_from is not None and 0 <= decay_from <= step else 0.0


def param_groups(model: torch.nn.Module, weight_decay: float, decay_embeddings: bool,
                 fusion_decay_from: int | None = 0, fusion_in_model: bool = False,
                 fusion_lr_multiplier: float = 1.0) -> list[dict]:
    """AdamW parameter groups; the ``group`` key names each one (kept by DeepSpeed and torch). The
    fusion's matrices get their own group, decayed from step ``fusion_decay_from`` (None: never) and
    stepped at the learning rate times ``fusion_lr_multiplier`` (its ``lr_multiplier``, which
    :meth:`Engine.set_lr` applies); see :meth:`Engine.set_step`.

    ``fusion_in_model``: the model has a fusion, possibly on another pipeline stage. ZeRO >= 1
    all-reduces one gradient norm per group over the model-parallel group, so every stage must hand
    DeepSpeed the same number of groups: a stage without the fusion splits its no-decay group in two
    (the same settings; the total norm is the same)."""
    decay, plain, fusion = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if no_weight_decay(name, p, decay_embeddings):
            plain.append(p)
        elif is_fusion(p):
            fusion.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "group": "decay"},
              {"params": plain, "weight_decay": 0.0, "group": "no_decay"},
              {"params": fusion, "weight_decay": fusion_weight_decay(weight_decay, fusion_decay_from, 0),
               "group": "fusion",
               "decay_from_step": -1 if fusion_decay_from is None else fusion_decay_from,
               "full_weight_decay": weight_decay, "lr_multiplier": fusion_lr_multiplier}]
    if fusion_in_model and not fusion:
        if len(plain) < 2:
            raise ValueError("a pipeline stage without the fusion needs two parameter groups in place of the "
                             f"fusion's (ZeRO all-reduces one norm per group); it has {len(plain)} no-decay "
                             "parameter(s) to split")
        half = len(plain) // 2
        groups[1:] = [{"params": plain[:half], "weight_decay": 0.0, "group": "no_decay"},
                      {"params": plain[half:], "weight_decay": 0.0, "group": "no_decay_2"}]
    return [g for g in groups if g["params"]]  # ZeRO cannot partition an empty group
