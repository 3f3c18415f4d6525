"""One interface for running a step's micro-batches, whatever the pipeline size.

:func:`get_runner` picks the runner once, by the pipeline-parallel size (as Megatron-Core's
``get_forward_backward_func`` does): :class:`WholeModelRunner` when every rank holds the whole model
(PP=1), :class:`~fbt_megatron.parallel.pipeline_runner.PipelineRunner` otherwise. Both have the same
``run(micro_batches, num_passes, *, training, scale, jitter_seeds, device) -> StepOutput``: forward of every
micro-batch with ``num_passes`` passes and, when ``training``, the backward of ``token loss * mask *
scale`` (through the engine when the runner has one, up to the accumulation boundary). With ``device``
the micro-batches may be on the host: the whole-model runner moves one at a time to ``device`` (peak memory
of one micro-batch, as evaluation over many batches needs), the pipeline runner all of them up front (its
schedule holds them all). The train step and evaluation use only this interface.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepOutput:
    loss_sum: torch.Tensor  # sum over micro-batches of (token loss * mask), float64, same on all stages
    residuals: list[torch.Tensor] = field(default_factory=list)  # per pass > 1, summed over micro-batches
    last_residual_max: torch.Tensor | None = None  # the last pass's largest residual over micro-batches
    op_seconds: list = field(default_factory=list)  # (op, start, end, waited) on this rank (benchmarks)


def to_device(batch: dict, device) -> dict:
    """``batch``'s tensors on ``device`` (as they are where ``device`` is None)."""
    if device is None:
        return batch
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


def micro_batch_forward(model, batch: dict, num_passes: int, jseed: int | None = None):
    return model(input_ids=batch["input_ids"], doc_start=batch["doc_start"], labels=batch["labels"],
                 num_passes=num_passes, jitter_seed=jseed)


class WholeModelRunner:
    """PP=1: each micro-batch goes forward through the whole model, then (training) backward.

    ``model`` is what the forward is called on: the DeepSpeed engine's module wrapper (``engine.ds``, so
    ZeRO-3 gathers its weights) or a bare model. With ``engine`` each micro-batch's backward goes
    through ``engine.backward``, the last one at the accumulation boundary."""

    def __init__(self, model, engine=None):
        self.model, self.engine = model, engine

    def run(self, micro_batches: list[dict], num_passes: int, *, training: bool, scale: float = 1.0,
            jitter_seeds: list | None = None, device=None) -> StepOutput:
        if device is None:
            device = micro_batches[0]["input_ids"].device if micro_batches else None
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        residuals, residual_max = None, None
        for j, batch in enumerate(micro_batches):
            batch = to_device(batch, device)  # one micro-batch on the device at a time
            # jitter_seeds[j]: global micro-batch dp_rank * len + j, contiguous DP blocks (see the loaders)
            out = micro_batch_forward(self.model, batch, num_passes, jitter_seeds[j] if jitter_seeds else None)
            tok_sum = (out.token_loss.float() * batch["loss_mask"]).sum()
            if training:
                if self.engine is not None:
                    self.engine.backward(tok_sum * scale, is_boundary=j == len(micro_batches) - 1)
                else:
                    (tok_sum * scale).backward()
            loss_sum += tok_sum.detach().to(torch.float64)
            if out.pass_residuals:
                r = torch.stack([x.detach().float() for x in out.pass_residuals])
                residuals = r if residuals is None else residuals + r
                last = out.pass_residuals[-1].detach().double()
                residual_max = last if residual_max is None else torch.maximum(residual_max, last)
        return StepOutput(loss_sum, [] if residuals is None else list(residuals), residual_max)


def get_runner(model, engine=None):
    """The runner for this rank's pipeline size. ``model``: the (stage's) FBT model, ``engine.model``
    when training; with ``engine`` the whole-model forward goes through ``engine.ds``."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        from fbt_megatron.parallel.pipeline_runner import PipelineRunner

        return PipelineRunner(model, engine=engine)
    return WholeModelRunner(engine.ds if engine is not None else model, engine=engine)


def engine_backward(engine):
    """A ``backward(tensors, grads)`` for :meth:`PipelineRunner.run` that goes through DeepSpeed:
    the vector-Jacobian product as the backward of the scalar sum(t * g) (exact: its gradient with
    respect to t is g), so ZeRO's gradient hooks, loss scaling and reductions see an ordinary
    ``engine.backward``. None of these calls is the accumulation boundary; see :func:`finish_backward`."""

    def backward(tensors, grads):
        surrogate = sum(t if g is None else (t * g).sum() for t, g in zip(tensors, grads))
        engine.backward(surrogate, is_boundary=False)

    return backward


def finish_backward(engine, model) -> None:
    """The accumulation boundary on this rank: one more backward, adding exactly zero to one
    parameter's gradient (ZeRO-2 sets up its reduction buckets only when some parameter's gradient
    arrives), so DeepSpeed runs its boundary reductions (ZeRO-0 all-reduce, ZeRO-1 reduce, ZeRO-2
    epilogue) over what the step's backward calls accumulated."""
    param = next(p for p in model.parameters() if p.requires_grad)
    engine.backward((param * 0.0).sum(), is_boundary=True)


class StepGradients:
    """A pipeline step's parameter gradients summed outside DeepSpeed (in fp32) and handed to it in ONE
    ``engine.backward`` at the accumulation boundary (:meth:`finish`). ZeRO-2 reduces a gradient every
    time its hook fires, i.e. in every backward call: through the engine, each of a step's m·k stage-pass
    backward ops would reduce every gradient of the stage again. The stage's gradients are held whole
    for the step instead (as ZeRO-1 holds them; Megatron's distributed optimizer does the same).

    :meth:`backward` is a ``backward(tensors, grads, leaves)`` for :meth:`PipelineRunner.run`: the
    gradients of the parameters go into the sums, those of ``leaves`` (the non-parameter tensors whose
    ``.grad`` the runner reads: received activations, the embedding leaves, the tied-weight copy) are
    accumulated into their ``.grad`` as torch's backward would."""

    def __init__(self, params):
        self.params = [p for p in params if p.requires_grad]
        self.sums: list = [None] * len(self.params)

    def backward(self, tensors, grads, leaves=()) -> None:
        leaves = [t for t in leaves if t is not None and t.requires_grad and t.is_leaf]
        got = torch.autograd.grad(tensors, self.params + leaves, grads, allow_unused=True)
        for i, g in enumerate(got[:len(self.params)]):
            if g is not None:
                self.sums[i] = g.float() if self.sums[i] is None else self.sums[i].add_(g)
        for leaf, g in zip(leaves, got[len(self.params):]):
            if g is not None:
                leaf.grad = g if leaf.grad is None else leaf.grad + g

    def finish(self, engine) -> None:
        """The step's one ``engine.backward``: the surrogate sum(p * g) has gradient g for each p (cast to
        p's dtype once), so DeepSpeed's hooks see each gradient once and reduce it once."""
        terms = [(p * g).sum() for p, g in zip(self.params, self.sums) if g is not None]
        surrogate = sum(terms) if terms else (self.params[0] * 0.0).sum()
        self.sums = [None] * len(self.params)
        engine.backward(surrogate, is_boundary=True)
