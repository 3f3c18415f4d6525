"""Learning-rate schedules as pure functions of the step (nothing to checkpoint but the step).

``cosine``: linear warmup to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at the last step.
``wsd`` (warmup-stable-decay): warmup, constant ``lr``, then a linear decay to ``min_lr_ratio * lr``
over the last ``decay_fraction`` of the steps. ``constant``: warmup then constant.
"""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, total_steps: int, kind: str = "cosine", warmup_steps: int = 0,
          min_lr_ratio: float = 0.1, decay_fraction: float = 0.2) -> float:
    """Learning rate used by optimiser step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    min_lr = lr * min_lr_ratio
    if kind == "constant":
        return lr
    if kind == "cosine":
        span = max(1, total_steps - warmup_steps - 1)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))
    if kind == "wsd":
        decay_steps = max(1, int(round(decay_fraction * total_steps)))
        decay_start = max(warmup_steps, total_steps - decay_steps)
        if step < decay_start:
            return lr
        progress = min(1.0, (step - decay_start + 1) / decay_steps)
        return lr + (min_lr - lr) * progress
    raise ValueError(f"lr_schedule.kind={kind!r}; allowed: cosine, wsd, constant")


class LRSchedule:
    def __init__(self, cfg, lr: float, total_steps: int):
        self.cfg, self.lr, self.total_steps = cfg, lr, total_steps

    def __call__(self, step: int) -> float:
        c = self.cfg
        return lr_at(step, lr=self.lr, total_steps=self.total_steps, kind=c.kind, warmup_steps=c.warmup_steps,
                     min_lr_ratio=c.min_lr_ratio, decay_fraction=c.decay_fraction)
