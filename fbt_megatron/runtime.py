"""The one place that knows which device we run on.

Everything else in fbt_megatron is device-agnostic: it asks this module for the device, the
distributed backend and the Megatron parallel state, and gets the same code path on a GPU cluster
(NCCL, CUDA RNG tracker) and on a CPU machine (gloo, a CPU RNG tracker).

Why shims are needed on CPU (megatron-core 0.16): tensor-parallel layers allocate buffers on
``torch.cuda.current_device()``, dropout inside attention forks ``get_cuda_rng_tracker()`` and the
dist_checkpointing writer calls ``torch.cuda.synchronize()``. We answer the first with ``"cpu"``,
make the sync a no-op and replace the tracker with one that saves/restores the CPU generator
(activation recomputation's CUDA-generator save/restore becomes a no-op as well). Nothing else in megatron-core's *layers* touches CUDA when built with
``use_cpu_initialization=True``. (Its pipeline schedules, DDP and distributed optimizer remain
CUDA-bound; fbt_megatron uses DeepSpeed for data parallelism instead.)
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


def quiet_known_warnings() -> None:
    """Silence warnings that say nothing actionable and repeat on every log line (called from the
    package's __init__): torch's ShardedTensor / load_state_dict deprecations, raised from inside
    megatron's dist_checkpointing on every save/load, and torch's all_gather_into_tensor deprecation, raised
    from megatron's tensor-parallel gathers on every rank; and on CPU, megatron's notes that apex/TE are
    absent and CUDA streams unused."""
    import warnings

    for pattern in (".*Please use DTensor instead.*", ".*`load_state_dict` is deprecated.*",
                    ".*`torch.distributed.all_gather_into_tensor` is deprecated.*"):
        warnings.filterwarnings("ignore", message=pattern)
    if use_cuda():
        return
    for pattern in (".*Apex is not installed.*", ".*Transformer Engine and Apex are not installed.*",
                    ".*CUDA_DEVICE_MAX_CONNECTIONS.*", ".*full scope is deprecated.*"):
        warnings.filterwarnings("ignore", message=pattern)


def use_cuda() -> bool:
    """CUDA is used when present, unless FBT_DEVICE=cpu forces the CPU path."""
    return os.environ.get("FBT_DEVICE", "").lower() != "cpu" and torch.cuda.is_available()


CPU_THREADS_ENV = "FBT_CPU_THREADS"


def usable_cpus() -> int:
    """The cores this process may run on (its affinity: a SLURM task's or taskset's, not the machine's)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def cpu_share(ways: int, cpu_count: int | None = None) -> int:
    """The usable cores (or ``cpu_count``) split ``ways`` ways, at least one thread each."""
    return max(1, (cpu_count if cpu_count is not None else usable_cpus()) // max(1, ways))


def cpu_threads(local_world: int, environ=os.environ, cpu_count: int | None = None) -> int:
    """Intra-op threads for one CPU rank: ``FBT_CPU_THREADS`` when it is a positive count, else the cores
    shared evenly among the node's ``local_world`` ranks. A variable of the project's own, not
    ``OMP_NUM_THREADS``: torchrun sets that to 1 in a multi-process run where it is unset, whatever the node's cores."""
    requested = environ.get(CPU_THREADS_ENV, "").strip()
    if requested.isdecimal() and int(requested) > 0:
        return int(requested)
    return cpu_share(local_world, cpu_count)


def device() -> torch.device:
    if use_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend() -> str:
    return "nccl" if use_cuda() else "gloo"


def default_dtype_name() -> str:
    """bf16 on GPU, fp32 on CPU (CPU bf16 matmuls are slow and not what tests compare).
    FBT_DTYPE=bf16|fp32 overrides it (e.g. to exercise DeepSpeed's bf16 optimisers on CPU)."""
    forced = os.environ.get("FBT_DTYPE", "").lower()
    if forced in ("bf16", "fp32"):
        return forced
    return "bf16" if use_cuda() else "fp32"


# --------------------------------------------------------------------------- CPU shims
_cpu_shims_installed = False


def _cpu_tracker_class():
    from megatron.core.tensor_parallel import random as mp_random

    class CPURNGStatesTracker(mp_random.CudaRNGStatesTracker):
        """Megatron's RNG-states tracker, keeping named *CPU* generator states."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CPURNGStatesTracker


def install_cpu_shims() -> None:
    """Make megatron-core's model layers run on CPU. Idempotent; a no-op on CUDA."""
    global _cpu_shims_installed
    if use_cuda() or _cpu_shims_installed:
        return
    from megatron.core.tensor_parallel import random as mp_random

    torch.cuda.current_device = lambda: "cpu"  # buffers allocated "on the current device"
    torch.cuda.synchronize = lambda *a, **k: None  # dist_checkpointing's writer syncs; nothing to wait for
    tracker_cls = _cpu_tracker_class()
    mp_random._CUDA_RNG_STATE_TRACKER = tracker_cls()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # initialize_rng_tracker() would otherwise replace our tracker with the CUDA one.
    mp_random.initialize_rng_tracker = lambda *a, **k: None
    # Activation recomputation (tensor_parallel.checkpoint) saves and restores the CUDA generator
    # next to the CPU one and the tracker's states; on CPU there is no CUDA generator to keep.
    mp_random._get_cuda_rng_state = lambda *a, **k: None
    mp_random._set_cuda_rng_state = lambda *a, **k: None
    _cpu_shims_installed = True


@contextlib.contextmanager
def cuda_calls_stay_on_cpu():
    """On CPU, ``tensor.cuda()`` returns the tensor itself inside this block (megatron's pipeline
    setup moves the last stage's tied embedding copy with ``.cuda()`` before all-reducing it).
    A no-op on CUDA."""
    if use_cuda():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


# --------------------------------------------------------------------------- init
@dataclass(frozen=True)
class ParallelLayout:
    tensor: int = 1
    pipeline: int = 1
    context: int = 1

    def data(self, world_size: int) -> int:
        model = self.tensor * self.pipeline * self.context
        if world_size % model:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor*pipeline*context = {model} "
                f"(tensor={self.tensor}, pipeline={self.pipeline}, context={self.context})"
            )
        return world_size // model


def init_distributed(timeout_minutes: float = 10, *, timeout_s: float | None = None) -> None:
    """Start torch.distributed from torchrun's env (RANK/WORLD_SIZE/MASTER_*), single-process if absent.
    ``timeout_s`` (or ``timeout_minutes``): how long a collective waits for a peer before it fails."""
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else datetime.timedelta(minutes=timeout_minutes)
    if use_cuda():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "RANK" in os.environ:
        dist.init_process_group(backend(), timeout=timeout, **_elastic_store(timeout))
    else:  # a world of one: an in-process store, no port (a port picked free could be taken before it is
        # bound, by a run started beside this one). MASTER_*/RANK stay unset so child processes start their
        # own; LOCAL_RANK is set because DeepSpeed insists on it (harmless to inherit).
        os.environ.setdefault("LOCAL_RANK", "0")
        dist.init_process_group(backend(), store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def _elastic_store(timeout) -> dict:
    """Under torchrun's c10d rendezvous the workers share the agent's TCPStore, which outlives a
    restart: without a prefix, restarted workers read the dead attempt's rank addresses (gloo then
    connects to a closed port and the restart fails). Prefix the keys with the attempt and world size."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    prefix = f"fbt/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/world{world}/"
    return {"store": dist.PrefixStore(prefix, store), "rank": rank, "world_size": world}


def init_parallel_state(layout: ParallelLayout, seed: int = 1234, timeout_s: float | None = None) -> None:
    """Megatron parallel groups + seeds. Call after init_distributed. ``timeout_s``: the collective
    timeout of Megatron's groups (TP, PP, DP, ...; megatron's default is 30 minutes)."""
    from megatron.core import parallel_state

    global _groups_made_for
    install_cpu_shims()
    layout.data(dist.get_world_size())  # validates divisibility with a clear message
    groups_for = (layout.tensor, layout.pipeline, layout.context, timeout_s, dist.group.WORLD)
    if parallel_state.model_parallel_is_initialized():
        if _groups_made_for == groups_for:  # keep them: Megatron's destroy leaves the old groups open
            set_seed(seed)
            seed_model_parallel_rngs(seed)
            return
        old_groups = megatron_groups()
        parallel_state.destroy_model_parallel()  # drops its references to the groups, closes only some
        for group in old_groups:
            if group in dist.distributed_c10d._world.pg_map:  # the registry Megatron's own destroy consults
                dist.destroy_process_group(group)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor,
        pipeline_model_parallel_size=layout.pipeline,
        context_parallel_size=layout.context,
        create_gloo_process_groups=not use_cuda(),
        **({} if timeout_s is None else {"distributed_timeout_minutes": timeout_s / 60.0}),
    )
    _groups_made_for = groups_for
    set_seed(seed)
    seed_model_parallel_rngs(seed)


_groups_made_for = None  # (tensor, pipeline, context, timeout, world group) Megatron's groups were made for


def megatron_groups() -> list:
    """The process groups Megatron's parallel state holds now (its module globals, with the lists and dicts
    of groups newer versions keep), the world group left out."""
    from megatron.core import parallel_state

    found: list = []
    for value in vars(parallel_state).values():
        if isinstance(value, dict):
            value = list(value.values())
        for group in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(group, dist.ProcessGroup) and group is not dist.group.WORLD \
                    and not any(group is f for f in found):
                found.append(group)
    return found


PIPELINE_SEED_STRIDE = 100  # Megatron-LM's _set_random_seed: seed + 100 * pipeline rank
TENSOR_SEED_OFFSET = 2718  # megatron.core.tensor_parallel.model_parallel_cuda_manual_seed's offset
EXPERT_SEED_OFFSET = 1024


def model_parallel_seeds(seed: int, tp_rank: int, pp_rank: int) -> dict[str, int]:
    """The seeds of Megatron's RNG tracker states for a rank (Megatron-LM's convention): every pipeline
    stage offsets the seed by 100 x its rank, so stage k's layers (initialised on the GPU from the
    tracker) and dropout do not replay stage 0's stream; the tensor-parallel state adds 2718 + TP rank."""
    from megatron.core.tensor_parallel import random as mp_random

    stage = seed + PIPELINE_SEED_STRIDE * pp_rank
    return {mp_random._DATA_PARALLEL_RNG_TRACKER_NAME: stage,
            mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME: stage + TENSOR_SEED_OFFSET + tp_rank,
            mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME: stage + EXPERT_SEED_OFFSET}


def seed_model_parallel_rngs(seed: int) -> None:
    """Seed Megatron's RNG tracker for this rank (:func:`model_parallel_seeds`): on CUDA through
    Megatron's ``model_parallel_cuda_manual_seed`` with the stage's seed (which also seeds the CUDA
    default generator), on CPU the CPU tracker with the same numbers. torch's CPU generator keeps
    ``seed`` on every rank: the model's CPU initialisation is seeded per global layer (layout-invariant)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    seeds = model_parallel_seeds(seed, tp_rank, pp_rank)
    if use_cuda():
        mp_random.model_parallel_cuda_manual_seed(seeds[mp_random._DATA_PARALLEL_RNG_TRACKER_NAME])
        return
    tracker = mp_random.get_cuda_rng_tracker()
    tracker.reset()
    for name, value in seeds.items():
        tracker.add(name, value)


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def shutdown() -> None:
    from megatron.core import parallel_state

    global _groups_made_for
    _groups_made_for = None
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
