"""The two places where the engine replaces a DeepSpeed method for correctness, and the DeepSpeed versions
they were written against (``tests/unit/test_engine_patches.py`` fails on any other version, so an upgrade is a
deliberate re-check of both):

1. :class:`SkippableStep` replaces the inner torch optimiser's ``step`` so a step can be skipped
   entirely (non-finite loss) and so the engine learns whether DeepSpeed stepped at all (it does not
   when it finds the gradient non-finite).
2. :func:`replace_zero0_clipping` replaces ``DeepSpeedEngine.clip_fp32_gradients`` (called only at
   ZeRO-0 in fp32, from ``_take_model_step``) with clipping that counts every parameter once over TP
   and PP (see :meth:`Engine._clip_fp32_gradients`).

ZeRO-1/2's CPU shortcuts (the one-rank bucket reduction, the kept flat gradient partition) are not here:
they are speed, not correctness, and live with the other CPU fast paths in ``model/cpu_fastpaths.py``.
"""

from __future__ import annotations

import torch

# DeepSpeed (major, minor) versions whose internals the patches below were checked against.
PATCHED_DEEPSPEED = ((0, 19),)


def deepspeed_version() -> tuple[int, int]:
    import deepspeed

    major, minor = deepspeed.__version__.split(".")[:2]
    return int(major), int(minor)


class SkippableStep:
    """Wraps the inner optimiser's ``step`` so the train step can skip one step entirely, and
    records whether DeepSpeed called it (it does not when it finds the gradient non-finite)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.skip_next = False
        self.stepped = False
        self._step = optimizer.step

        def step(*args, **kwargs):
            if self.skip_next:
                return None
            self.stepped = True
            return self._step(*args, **kwargs)

        optimizer.step = step


def replace_zero0_clipping(ds, clip) -> None:
    """ZeRO-0 fp32 clipping: DeepSpeed calls ``engine.clip_fp32_gradients()`` inside ``ds.step()``."""
    if hasattr(ds, "clip_fp32_gradients"):
        ds.clip_fp32_gradients = clip
