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

from data_pipeline.documents import with_packed_documents
from fbt_megatron.parallel.micro_batches import to_device


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
    attention_pairs: int = 0  # (query, key) pairs one pass attends over the global batch (causal, per document)


def jitter_seed(seed: int, step: int, micro_batch: int) -> int:
    """Deterministic jitter noise per (run seed, step, global micro-batch index)."""
    return (seed * 1_000_003 + step * 10_007 + micro_batch) % (2**63 - 1)


class FBTTrainStep:
    """One optimiser step: the micro-batches go through ``runner`` (:func:`~fbt_megatron.parallel.runner.get_runner`
    over ``engine``: the whole model per micro-batch, or the pipeline schedule), whose backward goes
    through the engine."""

    def __init__(self, engine, runner, schedule, seed: int, device, attention_mask: str = "document_causal"):
        from megatron.core import parallel_state as ps

        self.engine, self.runner, self.schedule, self.seed, self.device = engine, runner, schedule, seed, device
        self.attention_mask = attention_mask
        self.dp_group = ps.get_data_parallel_group()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()

    def __call__(self, step: int, micro_batches: list[dict], lr: float) -> StepResult:
        engine = self.engine
        k = self.schedule.num_passes(step)
        engine.train()
        engine.set_lr(lr)
        engine.set_step(step)
        micro_batches = [with_packed_documents(b) for b in micro_batches]  # made on the host, where absent
        pairs = sum(self._attention_pairs(b) for b in micro_batches)
        micro_batches = [to_device(b, self.device) for b in micro_batches]
        local_tokens = sum(b["loss_mask"].sum() for b in micro_batches).to(torch.float64)
        totals = self._sum_over_dp(torch.stack([local_tokens, torch.tensor(float(pairs), dtype=torch.float64,
                                                                           device=local_tokens.device)]))
        n_global, global_pairs = (float(v) for v in totals.tolist())
        scale = self.dp_size / max(n_global, 1.0)

        checksum = torch.zeros((), dtype=torch.int64, device=self.device)
        for b in micro_batches:
            ids = b["input_ids"]
            weights = torch.arange(1, ids.shape[1] + 1, device=ids.device)
            checksum += ((ids * weights).sum(1) * (ids[:, 0] + 7)).sum()
        self._sum_over_dp(checksum)
        jseeds = [jitter_seed(self.seed, step, self.dp_rank * len(micro_batches) + j) for j in range(len(micro_batches))]
        out = self.runner.run(micro_batches, k, training=True, scale=scale, jitter_seeds=jseeds)
        loss_sum = self._sum_over_dp(out.loss_sum.clone())
        loss = float(loss_sum.item()) / max(n_global, 1.0)
        outcome = engine.step(skip=not math.isfinite(loss))
        res = (torch.stack(out.residuals).float() / len(micro_batches)).tolist() if out.residuals else []
        return StepResult(step=step, num_passes=k, loss=loss, tokens=int(n_global), skipped=not outcome.applied,
                          grad_norm=outcome.grad_norm, lr=lr, residuals=res, data_checksum=int(checksum),
                          attention_pairs=int(global_pairs))

    def _attention_pairs(self, batch: dict) -> int:
        """(query, key) pairs one pass attends in a host-side micro-batch: d(d+1)/2 per packed document, or
        per row under ``model.attention_mask: causal``."""
        from fbt_megatron.train.callbacks import causal_pairs

        if self.attention_mask == "causal" or "cu_seqlens" not in batch:  # no doc_start: one document a row
            rows, seq = batch["input_ids"].shape
            return rows * seq * (seq + 1) // 2
        return causal_pairs(batch["cu_seqlens"].tolist())

    def _sum_over_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed in place over the data-parallel ranks. Over one rank it is the sum already, and
        not called: gloo would still hand it to its worker thread and wait."""
        if self.dp_size > 1:
            dist.all_reduce(tensor, group=self.dp_group)
        return tensor


@dataclass
class Evaluation:
    loss: float  # token-weighted mean over the batches of every DP rank
    last_residual: float | None  # largest last-pass Jacobi residual over the batches (None at 1 pass)


@torch.no_grad()
def evaluate(runner, batches: list[dict], num_passes: int, device) -> Evaluation:
    """Eval-mode loss over ``batches`` (this rank's share) and all DP ranks, run by ``runner``
    (:func:`~fbt_megatron.parallel.runner.get_runner`); the model's train/eval mode is restored afterwards."""
    from megatron.core import parallel_state as ps

    model = runner.model
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    residual = torch.full((), -1.0, dtype=torch.float64, device=device)
    # batches stay where they are: the runner moves them to the device (PP=1: one at a time, so peak memory
    # does not grow with the number of validation batches)
    out = runner.run(batches, num_passes, training=False, device=device)
    sums[0] += out.loss_sum
    sums[1] += sum((b["loss_mask"].sum().double() for b in batches), torch.zeros((), dtype=torch.float64)).to(device)
    if out.last_residual_max is not None:
        residual = out.last_residual_max.double()
    group = ps.get_data_parallel_group()
    dist.all_reduce(sums, group=group)
    dist.all_reduce(residual, op=dist.ReduceOp.MAX, group=group)
    model.train(was_training)
    return Evaluation(float(sums[0] / sums[1].clamp_min(1)), float(residual) if residual >= 0 else None)
