"""What both runners share: a micro-batch moved to the device, and a step's output."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RunnerOutput:
    loss_sum: torch.Tensor  # sum over micro-batches of (token loss * mask), float64, same on all stages
    residuals: list[torch.Tensor] = field(default_factory=list)  # per pass > 1, summed over micro-batches
    last_residual_max: torch.Tensor | None = None  # the last pass's largest residual over micro-batches
    op_seconds: list = field(default_factory=list)  # (op, start, end, waited) on this rank (benchmarks)


def to_device(batch: dict, device) -> dict:
    """``batch``'s tensors on ``device`` (as they are where ``device`` is None); host tensors bound for a GPU
    go through pinned memory, so the copy does not wait for the GPU's queue."""
    if device is None:
        return batch
    pin = torch.device(device).type == "cuda"

    def move(v):
        if pin and v.device.type == "cpu":
            v = v.pin_memory()
        return v.to(device, non_blocking=True)

    return {k: (move(v) if torch.is_tensor(v) else v) for k, v in batch.items()}
