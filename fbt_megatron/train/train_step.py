"""The FBT-specific part of training: one optimiser step of multi-pass teacher forcing.

Per step ``s``: ``k = PassSchedule.num_passes(s)`` (identical on every rank, a pure function of the
step, so it survives resume); every micro-batch is forwarded with ``num_passes=k``; the loss is the
token-weighted mean over the *whole global batch*:

    loss = sum_over_all_micro_batches_and_DP_ranks(token_loss * loss_mask) / sum(loss_mask)

Each micro-batch backpropagates ``sum(token_loss * mask) * DP / N_global`` (DeepSpeed then averages
over DP), so the gradient is the same for any split of the global batch into DP ranks and
accumulation steps: that is what makes DP=1 and DP=2 runs follow the same trajectory.

A non-finite global loss, or a non-finite gradient with a finite loss, skips the step (weights,
moments and Adam's step count untouched, at every ZeRO stage: see ``Engine.step``) and is counted;
the trainer stops after ``train.max_nonfinite_in_row`` such steps in a row.

Positions and the attention mask come from ``doc_start`` inside the model (``ModelConfig.attention_mask``),
not from the loader's ``position_ids``, so every data source trains the same layout as generation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class StepResult:
    step: int
    num_passes: int
    loss: float
    tokens: int  # loss tokens in the global batch
    skipped: bool
    grad_norm: float | None  # global, before clipping (inf/nan on a non-finite gradient)
    lr: float
    residuals: list[float] = field(default_factory=list)
    seconds: float = 0.0
    data_checksum: int = 0  # identifies the global batch's samples, whatever the DP layout


def jitter_seed(seed: int, step: int, micro_batch: int) -> int:
    """Deterministic jitter noise per (run seed, step, global micro-batch index)."""
    return (seed * 1_000_003 + step * 10_007 + micro_batch) % (2**63 - 1)


def micro_batch_forward(model, batch: dict, num_passes: int, jseed: int | None = None):
    return model(input_ids=batch["input_ids"], doc_start=batch["doc_start"], labels=batch["labels"],
                 num_passes=num_passes, jitter_seed=jseed)


# "loss:*" poisons the loss before backward (the gradient is non-finite too); "reported:*" only the loss
# the step reports, after a finite backward (the loss check alone must skip the step).
FAULT_KINDS = ("loss:nan", "loss:inf", "grad:nan", "grad:inf", "grad:zero", "reported:nan")


def normalise_faults(faults) -> dict[int, str]:
    """Test hook: ``{step: kind}`` (kinds in FAULT_KINDS), or an iterable of steps (= "loss:nan")."""
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


def _to_device(batch: dict, device) -> dict:
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


class FBTTrainStep:
    """One optimiser step. With ``pipeline`` (a :class:`~fbt_megatron.parallel.pipeline.PipelineRunner`)
    the micro-batches go through the pipeline schedule instead of one whole-model forward each."""

    def __init__(self, engine, schedule, seed: int, device, inject_nonfinite=None, pipeline=None):
        from megatron.core import parallel_state as ps

        self.engine, self.schedule, self.seed, self.device = engine, schedule, seed, device
        self.pipeline = pipeline
        self.dp_group = ps.get_data_parallel_group()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        # Test hook: {step: "loss:nan" | "loss:inf" | "grad:nan" | "grad:inf" | "grad:zero"}.
        self.faults = normalise_faults(inject_nonfinite)

    def __call__(self, step: int, micro_batches: list[dict], lr: float) -> StepResult:
        engine = self.engine
        k = self.schedule.num_passes(step)
        engine.train()
        engine.set_lr(lr)
        engine.set_step(step)
        micro_batches = [_to_device(b, self.device) for b in micro_batches]
        local_tokens = sum(b["loss_mask"].sum() for b in micro_batches).to(torch.float64)
        total_tokens = local_tokens.clone()
        dist.all_reduce(total_tokens, group=self.dp_group)
        n_global = float(total_tokens.item())
        scale = self.dp_size / max(n_global, 1.0)

        checksum = torch.zeros((), dtype=torch.int64, device=self.device)
        for b in micro_batches:
            ids = b["input_ids"]
            weights = torch.arange(1, ids.shape[1] + 1, device=ids.device)
            checksum += ((ids * weights).sum(1) * (ids[:, 0] + 7)).sum()
        dist.all_reduce(checksum, group=self.dp_group)
        jseeds = [jitter_seed(self.seed, step, self.dp_rank * len(micro_batches) + j) for j in range(len(micro_batches))]
        fault = self.faults.get(step, "")
        hook = None
        if fault in ("grad:nan", "grad:inf"):  # one gradient element non-finite, the loss finite
            first = next(p for p in engine.model.parameters() if p.requires_grad)
            hook = first.register_hook(_poison_first_element(float(fault.split(":")[1])))
        backward_scale = 0.0 if fault == "grad:zero" else scale
        try:
            if self.pipeline is not None:
                loss_sum, residuals = self._pipelined(micro_batches, k, backward_scale, jseeds)
                if fault.startswith("loss:"):
                    loss_sum = loss_sum * float(fault.split(":")[1])
            else:
                loss_sum, residuals = self._whole_model(micro_batches, k, backward_scale, jseeds, fault)
        finally:
            if hook is not None:
                hook.remove()
        if fault.startswith("reported:"):
            loss_sum = loss_sum * float(fault.split(":")[1])
        dist.all_reduce(loss_sum, group=self.dp_group)
        loss = float(loss_sum.item()) / max(n_global, 1.0)
        outcome = engine.step(skip=not math.isfinite(loss))
        res = [] if residuals is None else (residuals / len(micro_batches)).tolist()
        return StepResult(step=step, num_passes=k, loss=loss, tokens=int(n_global), skipped=not outcome.applied,
                          grad_norm=outcome.grad_norm, lr=lr, residuals=res, data_checksum=int(checksum))

    def _pipelined(self, micro_batches, k, scale, jseeds):
        from fbt_megatron.parallel.pipeline import engine_backward, finish_backward

        out = self.pipeline.run(micro_batches, k, training=True, scale=scale, jitter_seeds=jseeds,
                                backward=engine_backward(self.engine))
        finish_backward(self.engine, self.pipeline.model)
        residuals = torch.stack(out.residuals).float() if out.residuals else None
        return out.loss_sum.clone(), residuals

    def _whole_model(self, micro_batches, k, scale, jseeds, fault: str = ""):
        engine = self.engine
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        residuals = None
        for j, batch in enumerate(micro_batches):
            # jseeds[j]: global micro-batch dp_rank * len + j, contiguous DP blocks (see the loaders)
            out = micro_batch_forward(engine.ds, batch, k, jseeds[j])
            tok_sum = (out.token_loss.float() * batch["loss_mask"]).sum()
            if fault.startswith("loss:"):
                tok_sum = tok_sum * float(fault.split(":")[1])
            engine.backward(tok_sum * scale, is_boundary=j == len(micro_batches) - 1)
            loss_sum += tok_sum.detach().to(torch.float64)
            if out.pass_residuals:
                r = torch.stack([x.detach().float() for x in out.pass_residuals])
                residuals = r if residuals is None else residuals + r
        return loss_sum, residuals


@dataclass
class Evaluation:
    loss: float  # token-weighted mean over the batches of every DP rank
    last_residual: float | None  # largest last-pass Jacobi residual over the batches (None at 1 pass)


@torch.no_grad()
def evaluate(model, batches: list[dict], num_passes: int, device, pipeline=None) -> Evaluation:
    """Eval-mode loss of ``model`` (the DeepSpeed engine or a bare model) over ``batches`` (this
    rank's share) and all DP ranks; the model's train/eval mode is restored afterwards. With
    ``pipeline`` (a PipelineRunner on this rank's stage) the batches run through the pipeline."""
    from megatron.core import parallel_state as ps

    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    residual = torch.full((), -1.0, dtype=torch.float64, device=device)
    if pipeline is not None:
        batches = [_to_device(b, device) for b in batches]
        out = pipeline.run(batches, num_passes, training=False)
        sums[0] += out.loss_sum
        sums[1] += sum(b["loss_mask"].sum() for b in batches).double()
        if out.last_residual_max is not None:
            residual = out.last_residual_max
        batches = []
    for batch in batches:
        batch = _to_device(batch, device)
        out = micro_batch_forward(model, batch, num_passes, None)
        sums[0] += (out.token_loss.float() * batch["loss_mask"]).sum().double()
        sums[1] += batch["loss_mask"].sum().double()
        if out.pass_residuals:
            residual = torch.maximum(residual, out.pass_residuals[-1].double())
    group = ps.get_data_parallel_group()
    dist.all_reduce(sums, group=group)
    dist.all_reduce(residual, op=dist.ReduceOp.MAX, group=group)
    model.train(was_training)
    return Evaluation(float(sums[0] / sums[1].clamp_min(1)), float(residual) if residual >= 0 else None)
