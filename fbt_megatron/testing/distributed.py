"""Run a function on N real gloo processes and collect what each returns (or how it failed).

Used by the tests: ``run_distributed(fn, world_size=2, layout=ParallelLayout(tensor=2))`` starts
world_size processes (forkserver, so torch/megatron are imported once), initialises
torch.distributed over gloo and Megatron's parallel state, calls ``fn(*args)`` on every rank and
returns the list of results ordered by rank. A failure on any rank raises with that rank's traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import traceback

from fbt_megatron import runtime

_PRELOAD = ["torch", "torch.distributed", "megatron.core", "fbt_megatron.runtime"]


class DistributedTestFailure(RuntimeError):
    pass


def _worker(rank, world_size, port, layout, seed, fn, args, queue):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FBT_DEVICE="cpu",
    )
    import torch

    torch.set_num_threads(1)  # 2 cores shared by N processes: no oversubscription
    try:
        runtime.init_distributed(timeout_minutes=3)
        if layout is not None:
            runtime.init_parallel_state(layout, seed=seed)
        # Plain pickle: multiprocessing's pickler would share tensors through file descriptors
        # that die with this process before the parent reads them.
        queue.put((rank, "ok", pickle.dumps(fn(*args))))
    except BaseException:  # report every failure, including SystemExit
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            runtime.shutdown()
        except Exception:
            pass


def run_distributed(fn, world_size: int, *args, layout=None, seed: int = 1234, timeout: float = 600):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    queue = ctx.Queue()
    port = runtime._free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, layout, seed, fn, args, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, {}
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise DistributedTestFailure(f"{len(errors)} of {world_size} ranks failed:\n{msg}")
    return [results[r] for r in range(world_size)]


def child_pids(pid: int) -> list[int]:
    """The direct children of ``pid`` (e.g. torchrun's workers), sorted; [] once it is gone."""
    import psutil

    try:
        return sorted(c.pid for c in psutil.Process(pid).children())
    except psutil.NoSuchProcess:
        return []
