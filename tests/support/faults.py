"""Test hook: non-finite losses and gradients injected into chosen training steps.

``train(recipe, wrap_step=NonFiniteFaults({step: kind}))`` wraps the train step; at a faulty step it
wraps the step's runner for that one call, so the fault reaches the whole-model and the pipeline
runner the same way:

* ``loss:nan`` / ``loss:inf`` poison the loss before backward (the backward scale and the loss sum are
  multiplied by the value, so the gradient is non-finite too);
* ``grad:nan`` / ``grad:inf`` poison one gradient element of the first trainable parameter (the loss
  stays finite); ``grad:zero`` backpropagates a zero loss (an all-zero gradient);
* ``reported:nan`` poisons only the loss the step reports, after a finite backward (the loss check
  alone must skip the step).
"""

from __future__ import annotations

FAULT_KINDS = ("loss:nan", "loss:inf", "grad:nan", "grad:inf", "grad:zero", "reported:nan")


def normalise_faults(faults) -> dict[int, str]:
    """``{step: kind}`` (kinds in FAULT_KINDS), or an iterable of steps (= "loss:nan")."""
    if not faults:
        return {}
    if not isinstance(faults, dict):
        faults = {int(s): "loss:nan" for s in faults}
    for step, kind in faults.items():
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault {kind!r} at step {step}: allowed {FAULT_KINDS}")
    return {int(k): v for k, v in faults.items()}


def _poison_first_element(value: float):
    def hook(grad):
        grad = grad.clone()
        grad.view(-1)[0] = value
        return grad

    return hook


class _FaultyRunner:
    def __init__(self, runner, fault: str, params):
        self.runner, self.fault, self.params = runner, fault, params
        self.model = runner.model

    def run(self, micro_batches, num_passes, *, training, scale=1.0, jitter_seeds=None, **kw):
        kind, value = self.fault.split(":")
        factor = float(value) if value in ("nan", "inf") else 0.0
        hook = None
        if kind == "grad" and value in ("nan", "inf"):  # one gradient element non-finite, the loss finite
            first = next(p for p in self.params() if p.requires_grad)
            hook = first.register_hook(_poison_first_element(factor))
        if kind == "loss" or self.fault == "grad:zero":
            scale = scale * factor
        try:
            out = self.runner.run(micro_batches, num_passes, training=training, scale=scale,
                                  jitter_seeds=jitter_seeds, **kw)
        finally:
            if hook is not None:
                hook.remove()
        if kind in ("loss", "reported"):
            out.loss_sum = out.loss_sum * factor
        return out


class NonFiniteFaults:
    """A ``wrap_step`` for :func:`fbt_megatron.train.run.train`: ``NonFiniteFaults(faults)(step_fn)``."""

    def __init__(self, faults):
        self.faults = normalise_faults(faults)

    def __call__(self, step_fn):
        faults = self.faults

        def step(index, micro_batches, lr):
            fault = faults.get(index)
            if not fault:
                return step_fn(index, micro_batches, lr)
            runner = step_fn.runner
            step_fn.runner = _FaultyRunner(runner, fault, step_fn.engine.model.parameters)
            try:
                return step_fn(index, micro_batches, lr)
            finally:
                step_fn.runner = runner

        return step
