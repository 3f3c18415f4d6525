"""Per-rank RNG states as JSON (python, numpy, torch, cuda, and Megatron's RNG-states tracker, whose
"model-parallel-rng" state drives attention dropout): restorable without unpickling."""

from __future__ import annotations

import base64
import random

import numpy as np
import torch


def _tracker():
    from megatron.core.tensor_parallel import get_cuda_rng_tracker  # megatron-core: a required dependency

    return get_cuda_rng_tracker()


def _as_bytes(state) -> torch.Tensor:
    """A tracker state as a CPU byte tensor (a tensor, or a generator on graph-safe CUDA trackers)."""
    return (state if isinstance(state, torch.Tensor) else state.get_state()).detach().cpu()


def _tracker_states() -> dict:
    return {name: base64.b64encode(_as_bytes(st).numpy().tobytes()).decode()
            for name, st in _tracker().get_states().items()}


def _set_tracker_states(saved: dict) -> None:
    if not saved:
        return
    tracker = _tracker()
    states = tracker.get_states()
    for name, b64 in saved.items():
        new = torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.uint8)
        if isinstance(states.get(name), torch.Generator):
            states[name].set_state(new)
        else:
            states[name] = new.to(states[name].device) if isinstance(states.get(name), torch.Tensor) else new
    tracker.set_states(states)


def rng_state() -> dict:
    py = random.getstate()
    np_state = np.random.get_state()
    out = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    tracker = _tracker_states()
    if tracker:
        out["tracker"] = tracker
    return out


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8))
    _set_tracker_states(state.get("tracker", {}))
