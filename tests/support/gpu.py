"""Which device a test session runs on, and why a GPU test skips.

The CPU suite runs every test on the CPU path (``FBT_DEVICE=cpu``, DeepSpeed's CPU accelerator): the CPU
shims ``runtime`` installs are process-wide and cannot be taken back, so one session runs one device. A
session that selects only the GPU tests (``pytest -m gpu``, what ``make gpu-check`` runs) on a machine with
CUDA keeps the device CUDA; an ``FBT_DEVICE`` the caller set is never overridden."""

from __future__ import annotations

GPU_MARKER = "gpu"


def session_env(markexpr: str, environ, cuda_available: bool) -> dict[str, str]:
    """Environment variables the test session sets before anything imports fbt_megatron: the CPU path
    unless the session selects the GPU tests alone on a CUDA machine, or the caller chose FBT_DEVICE."""
    if "FBT_DEVICE" in environ:
        return {}
    if markexpr.strip() == GPU_MARKER and cuda_available:
        return {}
    return {"FBT_DEVICE": "cpu", "DS_ACCELERATOR": environ.get("DS_ACCELERATOR", "cpu")}


def gpu_skip_reason(use_cuda: bool, cuda_available: bool) -> str | None:
    """Why a GPU test cannot run in this session (None when it can), decided when the test runs."""
    if not cuda_available:
        return "no CUDA device (torch.cuda.is_available() is False)"
    if not use_cuda:
        return ("this session runs the CPU path (FBT_DEVICE=cpu): run the GPU tests alone with "
                "`pytest -m gpu` or `make gpu-check`")
    return None
