"""How many teacher-forcing passes each global batch gets.

Single-pass until ``feedback_start_step``; after it, k passes with probability ``mix[k-1]``
(default 75% / 22% / 3% for k = 1 / 2 / 3). The draw is a pure function of (seed, step): every rank
computes the same k without communication, and a resumed run draws exactly the sequence the
uninterrupted run would have drawn. The schedule's "position" is just the step.
"""

from __future__ import annotations

import numpy as np

from fbt_megatron.config import GRAD_MODES, FeedbackConfig, PassScheduleConfig


def _check_grad_mode(grad_mode: str) -> None:
    if grad_mode not in GRAD_MODES:
        raise ValueError(f"grad_mode must be 'all' or 'last', got {grad_mode!r}")


def step_forwards(passes: int, grad_mode: str) -> float:
    """Training FLOPs of a ``passes``-pass step in units of one forward F (backward = 2F): every pass
    forward, and backward through every pass (``grad_mode: all``, 3k) or only the last (``last``, k + 2)."""
    _check_grad_mode(grad_mode)
    return 3.0 * passes if grad_mode == "all" else passes + 2.0


def fusion_forwards(passes: int, grad_mode: str, fused_first_pass: bool = False) -> float:
    """The fusion's share of a ``passes``-pass step, in units of one fusion forward (backward = 2x): it
    runs in every pass that reads a state — passes 2..k under the ordinary first pass, every pass under
    ``feedback.first_input: state`` (``fused_first_pass``) — and is backpropagated with its pass."""
    _check_grad_mode(grad_mode)
    fused = passes if fused_first_pass else passes - 1
    if grad_mode == "all":
        return 3.0 * fused
    return fused + (2.0 if fused else 0.0)  # the last pass is fused whenever any is


def step_flops(passes: int, grad_mode: str, stack_flops: float, fusion_flops: float,
               fused_first_pass: bool = False) -> float:
    """Training FLOPs (per token) of a ``passes``-pass step from one forward of the stack (embedding to
    logits) and one of the fusion. ``fbt plan`` and the MFU that training logs both count with this."""
    return (step_forwards(passes, grad_mode) * stack_flops
            + fusion_forwards(passes, grad_mode, fused_first_pass) * fusion_flops)


class PassSchedule:
    """``feedback=False`` (a model without a fusion, ``feedback.fusion: off``): one pass every step, whatever
    the mix says, because without a fusion a second pass has no state to read."""

    def __init__(self, config: PassScheduleConfig, *, feedback: bool = True):
        self.config, self.feedback = config, feedback
        self._cumulative = np.cumsum(np.asarray(config.mix, dtype=np.float64))
        self._cumulative[-1] = 1.0  # guard the last bin against rounding

    @classmethod
    def of(cls, config: PassScheduleConfig, feedback: FeedbackConfig) -> PassSchedule:
        """The schedule a model with ``feedback`` trains by: one pass every step where its fusion is off."""
        return cls(config, feedback=feedback.fusion != "off")

    @property
    def max_passes(self) -> int:
        if not self.feedback:
            return 1
        return max(i + 1 for i, p in enumerate(self.config.mix) if p > 0)

    def num_passes(self, step: int) -> int:
        if not self.feedback or step < self.config.feedback_start_step:
            return 1
        # One independent, counter-based draw per step (Philox keyed by (seed, step)).
        u = np.random.Generator(np.random.Philox(key=self.config.seed, counter=[0, 0, 0, step])).random()
        return int(np.searchsorted(self._cumulative, u, side="right")) + 1

    def counts(self, first_step: int, last_step: int) -> dict[int, int]:
        """How many steps in [first_step, last_step) get each pass count."""
        out: dict[int, int] = {}
        for s in range(first_step, last_step):
            k = self.num_passes(s)
            out[k] = out.get(k, 0) + 1
        return out

    def state_dict(self) -> dict:
        """The schedule's settings (``num_passes`` is a pure function of the step, so it has no cursor)."""
        return self.config.model_dump()

    def load_state_dict(self, state: dict) -> None:
        """The pass count of every step follows from the recipe's schedule; only the seed may come from
        the checkpoint: where the recipe does not set ``schedule.seed`` (it then follows ``seed``), the
        run keeps the seed its checkpoint was trained with, so a run started before the seed followed
        the recipe's draws the same passes after resuming."""
        saved = state.get("seed")
        if saved is not None and saved != self.config.seed and self.config._seed_follows_recipe:
            self.config = self.config.model_copy(update={"seed": int(saved)})  # keeps _seed_follows_recipe
