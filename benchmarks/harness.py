"""What the benchmarks and the GPU check share with the tests (not shipped in the wheel; the tests import it
as ``benchmarks.harness``, a script here as ``harness``, its own directory being first on its path):

- ``run_distributed(fn, world_size, *args, layout=ParallelLayout(tensor=2))`` starts world_size processes
  (forkserver, so torch/megatron are imported once), initialises torch.distributed over gloo and Megatron's
  parallel state, calls ``fn(*args)`` on every rank and returns the results ordered by rank; a failure on
  any rank raises with that rank's traceback. A collective that waits past ``collective_timeout_s`` (default
  180 s, also in TINY's recipe) fails naming the rank, the collective and its process group.
- ``tiny_recipe(run_dir, **sections)``: the tiny recipe of the tests and checks (TINY), sections merged in.
- ``train_summary(recipe_data)``: ``fbt train`` of a recipe in this (already distributed) process, its summary.
- ``repo_module(path)``: a repository file that is not on the path (a test support module) loaded by path.
"""

from __future__ import annotations

import copy
import importlib.util
import multiprocessing as mp
import os
import pickle
import traceback
from pathlib import Path

from fbt_megatron import runtime

ROOT = Path(__file__).resolve().parents[1]
_PRELOAD = ["torch", "torch.distributed", "megatron.core", "fbt_megatron.runtime"]


class DistributedTestFailure(RuntimeError):
    pass


COLLECTIVE_TIMEOUT_S = 180  # a rank left waiting fails well within pytest's 900 s, naming what it waited for
_COLLECTIVES = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_object", "all_gather_into_tensor",
                "broadcast_object_list", "gather", "gather_object", "scatter", "reduce", "reduce_scatter",
                "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv", "monitored_barrier")


class CollectiveTimeout(RuntimeError):
    """A collective that waited past the timeout (or whose peer left), with the rank, the collective and its
    process group."""


def group_label(group) -> str:
    """A process group as a reader knows it: Megatron's name for it (when it is one of its groups) and its ranks."""
    import torch.distributed as dist

    if group is None or group is dist.GroupMember.WORLD:
        return f"the default (world) group, ranks 0-{dist.get_world_size() - 1}"
    names = []
    try:
        from megatron.core import parallel_state as ps

        for label, getter in (("data-parallel", "get_data_parallel_group"),
                              ("data-parallel (gloo)", "get_data_parallel_group_gloo"),
                              ("tensor-parallel", "get_tensor_model_parallel_group"),
                              ("pipeline-parallel", "get_pipeline_model_parallel_group"),
                              ("model-parallel", "get_model_parallel_group"), ("embedding", "get_embedding_group"),
                              ("context-parallel", "get_context_parallel_group")):
            try:
                if getattr(ps, getter)() is group:
                    names.append(label)
            except (AttributeError, AssertionError, RuntimeError, TypeError):
                continue
    except ImportError:
        pass
    ranks = dist.get_process_group_ranks(group)
    return f"{' / '.join(names) or 'a sub-group'} group, ranks {ranks}"


def name_collective_timeouts(timeout_s: float) -> None:
    """Make a collective of torch.distributed that times out raise :class:`CollectiveTimeout` naming this
    rank, the collective and its process group (gloo's own message names none of them)."""
    import torch.distributed as dist

    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "_names_timeouts", False):
            continue

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            try:
                return _fn(*args, **kwargs)
            except Exception as e:
                text = str(e).lower()
                timed_out = "timed out" in text or "timeout" in text
                if not timed_out and "closed by peer" not in text:
                    raise
                group = kwargs.get("group") or next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
                what = (f"waited {timeout_s:g} s in {_name} over {group_label(group)}, and a peer never joined (a "
                        f"collective over the wrong group, or a rank that took another path)" if timed_out else
                        f"was in {_name} over {group_label(group)} when a peer left (it failed first)")
                raise CollectiveTimeout(f"rank {dist.get_rank()} {what}: {str(e).splitlines()[0]}") from e

        wrapped._names_timeouts = True
        setattr(dist, name, wrapped)


def _worker(rank, world_size, port, layout, seed, fn, args, queue, collective_timeout_s=COLLECTIVE_TIMEOUT_S):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FBT_DEVICE="cpu",
    )
    import torch

    torch.set_num_threads(1)  # 2 cores shared by N processes: no oversubscription
    try:
        name_collective_timeouts(collective_timeout_s)
        runtime.init_distributed(timeout_s=collective_timeout_s)
        if layout is not None:
            runtime.init_parallel_state(layout, seed=seed, timeout_s=collective_timeout_s)
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


def run_distributed(fn, world_size: int, *args, layout=None, seed: int = 1234, timeout: float = 600,
                    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    queue = ctx.Queue()
    port = runtime._free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, layout, seed, fn, args, queue, collective_timeout_s))
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


TINY = {
    "name": "test",
    "seed": 1234,
    # vocab_pad_multiple 64: 128 rows at TP 1 and 2, so layouts compare row for row (padding: test_train_llama)
    "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128, "vocab_pad_multiple": 64,
              "max_sequence_length": 32},
    "feedback": {"jitter_std": 0.02},
    # Feedback from step 2 with a mix that makes multi-pass steps common in a short run.
    "schedule": {"feedback_start_step": 2, "mix": [0.2, 0.5, 0.3], "seed": 3},
    "parallel": {"tensor": 1, "zero_stage": 0},
    "batch": {"global_batch_size": 8, "micro_batch_size": 2},
    "optimizer": {"lr": 3e-3, "grad_clip": 1.0},
    "lr_schedule": {"kind": "cosine", "warmup_steps": 2},
    "data": {"seq_length": 32, "synthetic": {"vocab_size": 128}, "valid_sequences": 8},
    "train": {"steps": 6, "collective_timeout_s": COLLECTIVE_TIMEOUT_S},
    "logging": {"log_every": 100, "tensorboard": False},
    "eval": {"every": 1000, "at_end": False},
    "checkpoint": {"every": 1000, "at_end": False, "keep_last": 2},
}


def tiny_recipe(run_dir: str, **sections) -> dict:
    """TINY with ``sections`` merged in (one level deep: ``parallel={"zero_stage": 2}``)."""
    data = copy.deepcopy(TINY)
    data["run_dir"] = str(run_dir)
    for key, value in sections.items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    return data


def train_summary(recipe_data: dict) -> dict:
    """``fbt train`` of ``recipe_data`` in this (already distributed) process: its summary (quiet)."""
    from fbt_megatron.recipe import load_recipe
    from fbt_megatron.train.run import train

    return train(load_recipe(data=recipe_data), print_fn=lambda *a, **k: None).summary()


def repo_module(path: str):
    """The module in the repository file ``path`` (relative to the root), loaded by path: for a benchmark
    that uses a test support module (not importable by name from a script, and not in the wheel)."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
