"""One interface for running a step's micro-batches, whatever the pipeline size.

:func:`get_runner` picks the runner once, by the pipeline-parallel size (as Megatron-Core's
``get_forward_backward_func`` does): :class:`WholeModelRunner` when every rank holds the whole model
(PP=1), :class:`~fbt_megatron.parallel.pipeline_runner.PipelineRunner` otherwise. Both have the same
``run(micro_batches, num_passes, *, training, scale, jitter_seeds, device) -> RunnerOutput``: forward of every
micro-batch with ``num_passes`` passes and, when ``training``, the backward of ``token loss * mask *
scale`` (through the engine when the runner has one, up to the accumulation boundary). With ``device``
the micro-batches may be on the host: the whole-model runner moves one at a time to ``device`` (peak memory
of one micro-batch, as evaluation over many batches needs), the pipeline runner all of them up front (its
schedule holds them all). The train step and evaluation use only this interface.
"""

from __future__ import annotations

import torch

from fbt_megatron.parallel.micro_batches import RunnerOutput, to_device
from fbt_megatron.parallel.pipeline_runner import PipelineRunner


def micro_batch_forward(model, batch: dict, num_passes: int, jseed: int | None = None):
    return model(input_ids=batch["input_ids"], doc_start=batch["doc_start"], labels=batch["labels"],
                 num_passes=num_passes, jitter_seed=jseed, cu_seqlens=batch.get("cu_seqlens"),
                 max_seqlen=batch.get("max_seqlen"))


class WholeModelRunner:
    """PP=1: each micro-batch goes forward through the whole model, then (training) backward.

    ``model`` is what the forward is called on: the DeepSpeed engine's module wrapper (``engine.ds``, so
    ZeRO-3 gathers its weights) or a bare model. With ``engine`` each micro-batch's backward goes
    through ``engine.backward``, the last one at the accumulation boundary."""

    def __init__(self, model, engine=None):
        self.model, self.engine = model, engine

    def run(self, micro_batches: list[dict], num_passes: int, *, training: bool, scale: float = 1.0,
            jitter_seeds: list | None = None, device=None) -> RunnerOutput:
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
        return RunnerOutput(loss_sum, [] if residuals is None else list(residuals), residual_max)


def get_runner(model, engine=None):
    """The runner for this rank's pipeline size. ``model``: the (stage's) FBT model, ``engine.model``
    when training; with ``engine`` the whole-model forward goes through ``engine.ds``."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        return PipelineRunner(model, engine=engine)
    return WholeModelRunner(engine.ds if engine is not None else model, engine=engine)
