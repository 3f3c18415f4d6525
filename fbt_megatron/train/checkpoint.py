"""Sharded, atomically published, reshardable checkpoints.

Layout of ``<run>/checkpoints``::

    step_000120/            one published checkpoint
      weights/              megatron dist_checkpointing (torch_dist) directory: model weights and the
                            AdamW moments (``optimizer.exp_avg.<name>``, ``optimizer.exp_avg_sq.<name>``),
                            each a ShardedTensor with the parameter's TP sharding metadata
      state.json            step, optimiser step count, data cursor, pass-schedule position, counters
      rng/rank_00000.json   this rank's RNG states (python, numpy, torch; no pickle)
    latest                  text file with the name of the newest complete checkpoint (updated last)

Every tensor is full over data parallelism (gathered with DeepSpeed's ``safe_get_full_*`` helpers,
which work for ZeRO 0-3) and local over tensor parallelism, so a checkpoint loads under any DP size,
ZeRO stage or TP size: on load each rank reads the TP shard its new layout needs.

Publishing: ranks write into ``step_N.tmp``; after a barrier rank 0 fsyncs, renames it to ``step_N``
and then atomically replaces ``latest`` (write ``latest.tmp`` + ``os.replace``). A save killed
halfway leaves only a ``.tmp`` directory, which is ignored and removed by the next save; ``latest``
still names the previous checkpoint. Keep-last-N prunes older published checkpoints.

Loading never unpickles arbitrary code: ``state.json``/RNG files are JSON, megatron's ``common.pt``
is read with ``torch.load(weights_only=True)`` (torch's default) and the torch_dist ``.metadata``
file is read with a restricted unpickler that only admits torch's checkpoint-metadata classes.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import pickle
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

LATEST = "latest"
FORMAT_VERSION = 1


# ---------------------------------------------------------------------- safe metadata unpickling
_ALLOWED_PICKLE_PREFIXES = (
    "torch.distributed.checkpoint.",
    "torch.distributed._shard.",
    "megatron.core.dist_checkpointing.",
)
_ALLOWED_PICKLE_GLOBALS = {
    ("torch", "Size"), ("torch", "float32"), ("torch", "bfloat16"), ("torch", "float16"),
    ("torch", "float64"), ("torch", "int64"), ("torch", "int32"), ("torch", "uint8"), ("torch", "bool"),
    ("torch", "strided"), ("torch", "contiguous_format"), ("torch", "device"),
    ("torch", "dtype"), ("torch", "layout"), ("torch", "memory_format"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
    ("builtins", "getattr"), ("torch.serialization", "_get_layout"),
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _ALLOWED_PICKLE_GLOBALS or module.startswith(_ALLOWED_PICKLE_PREFIXES):
            if (module, name) == ("builtins", "getattr"):
                return _safe_getattr
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


def _safe_getattr(obj, name):
    # torch pickles dtypes/memory formats as getattr(torch, "float32"); nothing else is admitted.
    import torch as _torch

    if obj is _torch and isinstance(getattr(_torch, name, None), (_torch.dtype, _torch.layout,
                                                                   _torch.memory_format)):
        return getattr(_torch, name)
    raise pickle.UnpicklingError(f"checkpoint metadata calls getattr({obj!r}, {name!r}); not allowed")


class _SafePickleModule:
    """Stands in for the ``pickle`` module inside torch's checkpoint file-system reader."""

    def __getattr__(self, name):
        return getattr(pickle, name)

    @staticmethod
    def load(file, **kwargs):
        return _RestrictedUnpickler(file, **kwargs).load()

    @staticmethod
    def loads(data, **kwargs):
        return _RestrictedUnpickler(io.BytesIO(data), **kwargs).load()


def _install_safe_metadata_reader() -> None:
    from torch.distributed.checkpoint import filesystem

    if not isinstance(filesystem.pickle, _SafePickleModule):
        filesystem.pickle = _SafePickleModule()


# ---------------------------------------------------------------------- parameter templates
class ParamTemplates:
    """For every trainable parameter: its name and a ShardedTensor template (TP sharding metadata).

    Built from the model's ``sharded_state_dict()`` *before* DeepSpeed wraps it (ZeRO-3 empties the
    parameters' data afterwards). Parameters missing from it are saved as TP-replicated tensors.
    """

    def __init__(self, model: torch.nn.Module):
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing import ShardedTensor

        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

        by_id = {}
        for key, value in model.sharded_state_dict().items():
            # Factories: layouts that are not one plain shard (the SwiGLU fc1's [gate; up] halves, the
            # padded vocabulary's TP-independent chunks); dist_checkpointing builds/merges them.
            if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and isinstance(value.data, torch.nn.Parameter):
                by_id[id(value.data)] = value
        self.entries: list[tuple[str, torch.nn.Parameter, object]] = []
        self.local_shapes: dict[str, tuple] = {}  # recorded now: ZeRO-3 empties the parameters later
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            self.local_shapes[name] = tuple(p.shape)
            tpl = by_id.get(id(p))
            if tpl is None:
                tpl = ShardedTensor.from_rank_offsets(
                    name, p.detach(), replica_id=(0, ps.get_tensor_model_parallel_rank(),
                                                  ps.get_data_parallel_rank(with_context_parallel=True)))
            self.entries.append((name, p, tpl))

    @staticmethod
    def with_data(tpl, key: str, data: torch.Tensor):
        if not hasattr(tpl, "dtype"):  # a ShardedTensorFactory: its build_fn takes the new data
            return dataclasses.replace(tpl, key=key, data=data)
        return dataclasses.replace(tpl, key=key, data=data, dtype=data.dtype)


# ---------------------------------------------------------------------- full-over-DP state access
def _ds_managed(p) -> bool:
    """ZeRO-3 partitioned (ds_id) or linked to a flat fp32 partition (ZeRO 1/2, bf16 optimiser)."""
    return hasattr(p, "ds_id") or getattr(p, "_hp_mapping", None) is not None


def full_param(p: torch.nn.Parameter) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_fp32_param

    v = safe_get_full_fp32_param(p)
    return (p.detach() if v is None else v).float().clone().reshape(getattr(p, "ds_shape", p.shape))


def full_opt_state(engine, p: torch.nn.Parameter, key: str) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_optimizer_state

    if not _ds_managed(p):
        return engine.torch_optimizer.state[p][key].detach().float().clone()
    v = safe_get_full_optimizer_state(p, key)
    return v.float().clone().reshape(getattr(p, "ds_shape", p.shape))


def set_full_param(engine, p: torch.nn.Parameter, value: torch.Tensor) -> None:
    from deepspeed.utils import safe_set_full_fp32_param

    if _ds_managed(p):
        safe_set_full_fp32_param(p, value.to(torch.float32))
    if not hasattr(p, "ds_id"):
        with torch.no_grad():
            p.data.copy_(value.to(p.dtype))


def set_full_opt_state(engine, p: torch.nn.Parameter, key: str, value: torch.Tensor) -> None:
    from deepspeed.utils import safe_set_full_optimizer_state

    if not _ds_managed(p):
        engine.torch_optimizer.state[p][key].copy_(value.view_as(p))
    else:
        safe_set_full_optimizer_state(p, value.to(torch.float32), key)


# ---------------------------------------------------------------------- RNG (JSON, no pickle)
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
    return out


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8))


# ---------------------------------------------------------------------- the manager
def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(root))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fault(point: str, step: int) -> None:
    """Test hook: FBT_CKPT_FAULT=<point>[@<step>] kills this process at that point of a save."""
    want = os.environ.get("FBT_CKPT_FAULT", "")
    if want and want.split("@")[0] == point and ("@" not in want or int(want.split("@")[1]) == step):
        os._exit(17)


class CheckpointManager:
    def __init__(self, root: str | Path, keep_last: int = 2, async_save: bool = False):
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_save = async_save
        self._pending = None  # (AsyncCallsQueue, step) when async saving
        _install_safe_metadata_reader()

    # ------------------------------------------------------------------ discovery
    def latest(self) -> Path | None:
        pointer = self.root / LATEST
        if not pointer.exists():
            return None
        name = pointer.read_text().strip()
        path = self.root / name
        if not (path / "state.json").exists():
            raise RuntimeError(f"{pointer} names {name}, which is not a complete checkpoint")
        return path

    @staticmethod
    def read_state(path: Path) -> dict:
        return json.loads((Path(path) / "state.json").read_text())

    # ------------------------------------------------------------------ save
    def save(self, step: int, engine, templates: ParamTemplates, state: dict) -> Path:
        from megatron.core import dist_checkpointing

        self.wait()  # one save in flight at a time
        rank = dist.get_rank()
        name = f"step_{step:08d}"
        final, tmp = self.root / name, self.root / f"{name}.tmp"
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("*.tmp"):  # leftovers of a save that was killed
                shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink()
            if final.exists():
                shutil.rmtree(final)
            (tmp / "weights").mkdir(parents=True)
            (tmp / "rng").mkdir()
        dist.barrier()

        sharded = {}
        for pname, p, tpl in templates.entries:  # collective under ZeRO: same order on all ranks
            sharded[pname] = templates.with_data(tpl, tpl.key, full_param(p))
            for key in ("exp_avg", "exp_avg_sq"):
                okey = f"optimizer.{key}.{tpl.key}"  # the ShardedTensor key (layers share one, by offset)
                sharded[f"optimizer.{key}.{pname}"] = templates.with_data(tpl, okey, full_opt_state(engine, p, key))
        (tmp / "rng" / f"rank_{rank:05d}.json").write_text(json.dumps(rng_state()))
        state = dict(state, format_version=FORMAT_VERSION, saved_at=time.time(),
                     world_size=dist.get_world_size())
        _fault("before_weights", step)
        if self.async_save:
            request = dist_checkpointing.save(sharded, str(tmp / "weights"), async_sharded_save=True)
            request.add_finalize_fn(lambda: self._publish(tmp, final, state, step))
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            queue = AsyncCallsQueue()
            queue.schedule_async_request(request)
            self._pending = queue
        else:
            dist_checkpointing.save(sharded, str(tmp / "weights"))
            _fault("after_weights", step)
            self._publish(tmp, final, state, step)
        return final

    def _publish(self, tmp: Path, final: Path, state: dict, step: int) -> None:
        dist.barrier()
        if dist.get_rank() == 0:
            (tmp / "state.json").write_text(json.dumps(state, indent=1, sort_keys=True))
            _fsync_tree(tmp)
            _fault("before_rename", step)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            _fault("before_latest", step)
            pointer_tmp = self.root / f"{LATEST}.tmp"
            pointer_tmp.write_text(final.name + "\n")
            with open(pointer_tmp) as f:
                os.fsync(f.fileno())
            os.replace(pointer_tmp, self.root / LATEST)
            _fsync_dir(self.root)
            self._prune()
        dist.barrier()

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.maybe_finalize_async_calls(blocking=True, no_dist=False)
            self._pending.close()
            self._pending = None

    def _prune(self) -> None:
        published = sorted(p for p in self.root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in published[: max(0, len(published) - self.keep_last)]:
            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ load
    def _load_tensors(self, path: Path, templates: ParamTemplates, with_optimizer: bool) -> dict:
        from megatron.core import dist_checkpointing

        request = {}
        for pname, p, tpl in templates.entries:
            shape = templates.local_shapes[pname]
            request[pname] = templates.with_data(tpl, tpl.key, torch.zeros(shape, dtype=torch.float32))
            if with_optimizer:
                for key in ("exp_avg", "exp_avg_sq"):
                    okey = f"optimizer.{key}.{tpl.key}"
                    request[f"optimizer.{key}.{pname}"] = templates.with_data(
                        tpl, okey, torch.zeros(shape, dtype=torch.float32))
        return dist_checkpointing.load(request, str(Path(path) / "weights"))

    def load_weights(self, path: Path, templates: ParamTemplates) -> None:
        """Model weights into the (not yet DeepSpeed-wrapped) model."""
        loaded = self._load_tensors(path, templates, with_optimizer=False)
        with torch.no_grad():
            for pname, p, _ in templates.entries:
                p.data.copy_(loaded[pname].to(p.dtype).view_as(p))

    def load_training_state(self, path: Path, engine, templates: ParamTemplates) -> dict:
        """fp32 master weights, AdamW moments and step count into the DeepSpeed engine; RNG; state."""
        state = self.read_state(path)
        loaded = self._load_tensors(path, templates, with_optimizer=True)
        for pname, p, tpl in templates.entries:
            set_full_param(engine, p, loaded[pname])
            for key in ("exp_avg", "exp_avg_sq"):
                set_full_opt_state(engine, p, key, loaded[f"optimizer.{key}.{pname}"])
        engine.set_optimizer_step(int(state["optimizer_steps"]))
        rng_file = Path(path) / "rng" / f"rank_{dist.get_rank():05d}.json"
        if rng_file.exists() and state.get("world_size") == dist.get_world_size():
            set_rng_state(json.loads(rng_file.read_text()))
        return state
