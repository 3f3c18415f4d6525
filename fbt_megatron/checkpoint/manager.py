"""Sharded, atomically published checkpoints that load into any parallel layout.

Layout of ``<run>/checkpoints``::

    step_00000120/          one published checkpoint
      weights/              megatron dist_checkpointing (torch_dist) directory: fp32 master weights
                            (``<key>``) and AdamW moments (``optimizer.exp_avg.<key>``,
                            ``optimizer.exp_avg_sq.<key>``); every rank writes its own ``__<rank>_*.distcp``
      rng/rank_00000.json   each rank's RNG states (JSON)
      manifest.json         every file's size and CRC-32 (each rank checksums the files it wrote)
      state.json            step, optimiser step count, layout, data cursor, pass schedule, recipe
      tokenizer.model       the run's tokenizer (runs on tokenized data): the checkpoint is self-contained
    latest                  the name of the newest complete checkpoint (replaced atomically, last)

What each rank writes and reads is described in :mod:`fbt_megatron.checkpoint.shards`: its ZeRO
fragment of every parameter's fp32 master weights and moments (ZeRO-0: DP rank 0 writes the whole
TP-local tensor), as views of DeepSpeed's buffers; loading reads, under the new layout, exactly the
rectangles the rank's new fragments cover, straight into DeepSpeed's buffers, then refreshes the model's
parameters from the masters (DeepSpeed's own post-step path).

Publishing: ranks write into ``step_N.tmp``; once every rank's write has completed, rank 0 writes the
manifest and ``state.json``, fsyncs, renames the directory to ``step_N`` and atomically replaces
``latest``. A save killed halfway leaves only ``step_N.tmp`` (ignored, removed by the next save).
Re-saving an existing step first moves the published directory aside to ``step_N.old`` (which
:meth:`CheckpointManager.latest` falls back to if a crash happens in between) and deletes it only
after the replacement is published. Pruning keeps ``latest``'s target and the ``keep_last - 1`` newest
checkpoints before it; it never deletes what ``latest`` names.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from fbt_megatron.checkpoint.discovery import (  # noqa: F401 (public here too)
    LATEST,
    STEP_DIR,
    CheckpointError,
    file_crc32,
    follow_latest,
    read_checkpoint_state,
    resolve_checkpoint,
    step_dirs,
)
from fbt_megatron.checkpoint.rng import rng_state, set_rng_state
from fbt_megatron.checkpoint.safe_load import install_safe_metadata_reader
from fbt_megatron.checkpoint.shards import Fragment, ParamSpec, StateFragments, storage_key
from fbt_megatron.engine.zero_state import STATE_NAMES

FORMAT_VERSION = 2


# ---------------------------------------------------------------------- file checks
def check_files_present(path: Path, *, use: str = "resume") -> dict:
    """Every file the manifest lists exists with its recorded size (cheap; ``fbt ckpt verify`` also
    checks the CRCs). Returns the manifest. A refusal says what to do for ``use`` (``guards.where_to_go``)."""
    from fbt_megatron.checkpoint.guards import where_to_go

    manifest_file = path / "manifest.json"
    if not manifest_file.exists():
        raise CheckpointError(f"{manifest_file} is missing: {path} is incomplete or from an older format")
    manifest = json.loads(manifest_file.read_text())
    for rel, info in manifest["files"].items():
        f = path / rel
        if not f.exists():
            raise CheckpointError(f"checkpoint file {f} is missing (expected {info['bytes']} bytes), so "
                                  f"{path.name} was not loaded: {where_to_go(path, use)}")
        size = f.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"checkpoint file {f} has {size} bytes, expected {info['bytes']} bytes "
                                  f"(truncated or overwritten), so {path.name} was not loaded: "
                                  f"{where_to_go(path, use)}")
    return manifest


def read_tensor_metadata(path: Path) -> dict:
    """``{key: (global shape, dtype, [(offsets, sizes), ...])}`` from torch_dist's ``.metadata``
    (read with the restricted unpickler)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    install_safe_metadata_reader()
    md = FileSystemReader(str(path / "weights")).read_metadata()
    return {k: (tuple(v.size), v.properties.dtype, [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks])
            for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def read_full_tensors(path: str | Path, keys=None) -> dict:
    """Whole tensors of a checkpoint in one process, no process group (tests, single-process tools;
    holds every requested tensor in full, so not for large models)."""
    import torch.distributed.checkpoint as dcp

    path = resolve_checkpoint(path)
    meta = read_tensor_metadata(path)
    state = {k: torch.zeros(shape, dtype=dtype) for k, (shape, dtype, _) in meta.items() if keys is None or k in keys}
    dcp.load(state, checkpoint_id=str(path / "weights"), no_dist=True)
    return state


def check_shapes(path: Path, specs: list[ParamSpec], which=STATE_NAMES, what_to_do: str = "") -> None:
    """Raise :class:`CheckpointError` naming the first tensor the checkpoint lacks or holds in another shape
    than the model's; ``what_to_do`` ends the sentence."""
    stored = read_tensor_metadata(path)
    meta_file = path / "weights" / ".metadata"
    for spec in specs:
        for w in which:
            key = storage_key(spec.key, w)
            if key not in stored:
                raise CheckpointError(f"{meta_file} has no tensor {key!r} (parameter {spec.name}, expected "
                                      f"global shape {list(spec.global_shape)}): not a checkpoint of this model"
                                      + what_to_do)
            if stored[key][0] != tuple(spec.global_shape):
                raise CheckpointError(f"{meta_file}: tensor {key!r} has shape {list(stored[key][0])}, the "
                                      f"recipe's model expects {list(spec.global_shape)} (parameter {spec.name})"
                                      + what_to_do)


# ---------------------------------------------------------------------- reading tensors
def _load_fragments(path: Path, fragments: list[Fragment], which=STATE_NAMES) -> None:
    """Read every fragment's rectangles from ``path/weights`` straight into its tensors."""
    from megatron.core import dist_checkpointing

    install_safe_metadata_reader()
    request, views = {}, {}
    for i, frag in enumerate(fragments):
        frag = Fragment(frag.spec, frag.start, frag.numel, {w: frag.tensors[w] for w in which}, frag.dp_replicated)
        for key, pieces in frag.pieces(dp_rank=0).items():
            for j, piece in enumerate(pieces):
                name = f"{i}/{key}/{j}"
                request[name], views[name] = piece, piece.data
    try:
        loaded = dist_checkpointing.load(request, str(path / "weights"), validate_access_integrity=False)
    except CheckpointError:
        raise
    except Exception as e:  # name the checkpoint; the cause stays attached
        raise CheckpointError(f"reading {path / 'weights'} failed: {type(e).__name__}: {e}") from e
    for name, view in views.items():
        got = loaded[name]
        if got.data_ptr() != view.data_ptr():  # loaded elsewhere (not in place): copy
            view.copy_(got)


# ---------------------------------------------------------------------- weights only
@torch.no_grad()
def load_model_weights(path: str | Path, model: torch.nn.Module, verify: bool = True, use: str = "read") -> Path:
    """Fill a bare (not DeepSpeed-wrapped) model's parameters from a checkpoint's fp32 master weights,
    in the current TP layout (call on every rank of the process group). Returns the checkpoint dir.
    ``verify``: check every file's CRC-32 first (see :mod:`.guards`); ``use`` ("read" or "init_from"):
    what a refusal advises."""
    from fbt_megatron.checkpoint.shards import param_specs, whole_tensor_fragment

    path = resolve_checkpoint(path)
    check_files_present(path, use=use)
    if verify:
        from fbt_megatron.checkpoint.guards import verify_checksums

        verify_checksums(path, use=use)
    specs = param_specs(model)
    check_shapes(path, specs, which=("param",))
    fragments, copies = [], []
    for spec in specs:
        p = spec.param
        target = p.data if p.dtype == torch.float32 else torch.empty(spec.local_shape, dtype=torch.float32)
        fragments.append(whole_tensor_fragment(spec, {"param": target}, dp_replicated=True))
        if target is not p.data:
            copies.append((p, target))
    _load_fragments(path, fragments, which=("param",))
    for p, target in copies:
        p.data.copy_(target.view_as(p).to(p.dtype))
    return path


# ---------------------------------------------------------------------- writing tensors
def _write_pieces(pieces: list, weights_dir: Path) -> None:
    """Synchronous torch_dist save of this rank's main-replica pieces, through PyTorch DCP's own file
    writer: it serialises one piece at a time (megatron's writer would first copy every piece that is a
    view, i.e. this rank's whole shard, and fork writer processes). Same files as megatron writes, so
    ``dist_checkpointing.load`` reads them. Collective."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.strategies.torch import mcore_to_pyt_state_dict
    from torch.distributed.checkpoint import FileSystemWriter

    grouped: dict[str, list] = {}
    for piece in pieces:
        if not any(piece.replica_id):  # another rank writes the other replicas' identical bytes
            grouped.setdefault(piece.key, []).append(piece)
    state = mcore_to_pyt_state_dict(grouped, is_loading=False)
    # DCP checks the global plan: the pieces of every tensor must tile it exactly (no gap, no overlap).
    dcp.save(state, storage_writer=FileSystemWriter(str(weights_dir), thread_count=1))
    if dist.get_rank() == 0:
        torch.save({}, weights_dir / "common.pt")  # megatron's (empty) non-sharded part
        save_config(CheckpointingConfig(sharded_backend="torch_dist"), str(weights_dir))


# ---------------------------------------------------------------------- the manager
def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            _fsync_file(Path(root) / f)
        _fsync_file(Path(root))


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


FaultHook = Callable[[str, int], None]  # (point, step): tests kill or raise at a point of a save


class CheckpointManager:
    def __init__(self, root: str | Path, keep_last: int = 2, async_save: bool = False,
                 fault_hook: FaultHook | None = None, verify_on_load: bool = True):
        self.root = Path(root)
        self.verify_on_load = verify_on_load
        self.keep_last = keep_last
        self.async_save = async_save
        self.fault_hook = fault_hook
        self._queue = None  # megatron AsyncCallsQueue while an async save is in flight
        self.last_published: Path | None = None
        install_safe_metadata_reader()

    def _fault(self, point: str, step: int) -> None:
        if self.fault_hook is not None:
            self.fault_hook(point, step)

    # ------------------------------------------------------------------ discovery
    def latest(self) -> Path | None:
        return follow_latest(self.root) if (self.root / LATEST).exists() else None

    def has_checkpoints(self) -> bool:
        return (self.root / LATEST).exists() or bool(step_dirs(self.root))

    # ------------------------------------------------------------------ save
    def save(self, step: int, zero: StateFragments, state: dict, files: dict[str, Path] | None = None) -> Path:
        """Write this rank's fragments; publish when every rank's write is complete (at once, or for an
        async save at the first :meth:`poll` that finds it done). ``files``: {name: source} copied into
        the checkpoint by rank 0 (e.g. the tokenizer), listed in the manifest. Refused (``SaveRefused``,
        ``latest`` kept) when the state is not finite or the disk has no room (:mod:`.guards`). Collective."""
        from megatron.core import parallel_state as ps

        from fbt_megatron.checkpoint.guards import check_before_save

        self.wait()  # one save in flight at a time
        name = f"step_{step:08d}"
        final, tmp = self.root / name, self.root / f"{name}.tmp"
        latest = self.latest()
        check_before_save(self.root, step, zero.fragments(), ps.get_data_parallel_rank(), latest)
        try:
            return self._save(step, zero, state, files, final, tmp)
        except Exception as e:
            self._out_of_space(e, step, tmp, latest)
            raise

    def _out_of_space(self, e: Exception, step: int, tmp: Path, latest: Path | None) -> None:
        """An out-of-space error during a save becomes one sentence; the partial ``.tmp`` is removed."""
        from fbt_megatron.checkpoint.guards import SaveRefused, free_bytes, is_out_of_space, out_of_space_message

        if not is_out_of_space(e):
            return
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        kept = f"{self.root / LATEST} still names {latest.name}" if latest is not None else "no checkpoint is published"
        raise SaveRefused(out_of_space_message(self.root, step, None, free_bytes(self.root), kept)) from e

    def _save(self, step: int, zero: StateFragments, state: dict, files, final: Path, tmp: Path) -> Path:
        """The save itself: write into ``tmp``, publish as ``final`` (see :meth:`save`)."""
        from megatron.core import dist_checkpointing

        rank = dist.get_rank()
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            self._clean_leftovers()
            (tmp / "weights").mkdir(parents=True)
            (tmp / "rng").mkdir()
            for name, source in (files or {}).items():
                shutil.copyfile(source, tmp / name)
        dist.barrier()

        from megatron.core import parallel_state as ps

        dp_rank = ps.get_data_parallel_rank()
        sharded = {}
        for i, frag in enumerate(zero.fragments()):
            # Async: the buffers change with the next step while the write runs, so it writes a copy
            # (this rank's own shard, bounded); a synchronous save writes the buffers themselves.
            for key, pieces in frag.pieces(dp_rank, clone=self.async_save).items():
                for j, piece in enumerate(pieces):
                    sharded[f"{i}/{key}/{j}"] = piece
        _write_json(tmp / "rng" / f"rank_{rank:05d}.json", rng_state())
        state = dict(state, format_version=FORMAT_VERSION, saved_at=time.time(), world_size=dist.get_world_size())
        self._fault("before_weights", step)
        if self.async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            request = dist_checkpointing.save(sharded, str(tmp / "weights"), async_sharded_save=True,
                                              validate_access_integrity=False)
            request.add_finalize_fn(lambda: self._publish(tmp, final, state, step))
            self._queue = AsyncCallsQueue()
            self._queue.schedule_async_request(request)
        else:
            _write_pieces(list(sharded.values()), tmp / "weights")
            self._publish(tmp, final, state, step)
        return final

    def _clean_leftovers(self) -> None:
        for stale in self.root.glob("*.tmp"):  # a save that was killed
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink()
        for aside in self.root.glob("step_*.old"):  # a re-save interrupted between its renames
            original = self.root / aside.name[: -len(".old")]
            if original.exists():
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.replace(aside, original)

    def _publish(self, tmp: Path, final: Path, state: dict, step: int) -> None:
        """Every rank's write is complete: checksum, then rank 0 publishes. Collective."""
        rank = dist.get_rank()
        self._fault("after_weights", step)
        mine = {}
        for f in sorted((tmp / "weights").glob(f"__{rank}_*.distcp")) + [tmp / "rng" / f"rank_{rank:05d}.json"]:
            mine[str(f.relative_to(tmp))] = {"bytes": f.stat().st_size, "crc32": file_crc32(f)}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            files = {k: v for part in gathered for k, v in part.items()}
            extra = [p for p in tmp.iterdir() if p.is_file() and p.name not in ("manifest.json", "state.json")]
            for f in sorted(p for p in (tmp / "weights").iterdir() if p.is_file()) + sorted(extra):
                rel = str(f.relative_to(tmp))
                if rel not in files:  # .metadata, common.pt, metadata.json (rank 0's)
                    files[rel] = {"bytes": f.stat().st_size, "crc32": file_crc32(f)}
            _write_json(tmp / "manifest.json", {"format_version": FORMAT_VERSION, "files": files})
            _write_json(tmp / "state.json", state)
            _fsync_tree(tmp)
            self._fault("before_rename", step)
            aside = self.root / f"{final.name}.old"
            if final.exists():  # re-save of a published step: keep it until the new one is in place
                os.replace(final, aside)
                self._fault("between_renames", step)
            os.replace(tmp, final)
            _fsync_file(self.root)
            self._fault("before_latest", step)
            pointer_tmp = self.root / f"{LATEST}.tmp"
            pointer_tmp.write_text(final.name + "\n")
            _fsync_file(pointer_tmp)
            os.replace(pointer_tmp, self.root / LATEST)
            _fsync_file(self.root)
            shutil.rmtree(aside, ignore_errors=True)
            self._prune(final)
        self.last_published = final
        dist.barrier()

    def poll(self) -> None:
        """Publish a finished async save now (collective: call on every rank, e.g. at each step end)."""
        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=False, no_dist=False)
            if self._queue.get_num_unfinalized_calls() == 0:
                self._queue.close()
                self._queue = None

    def wait(self) -> None:
        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
            self._queue.close()
            self._queue = None

    def _prune(self, latest: Path) -> None:
        m = STEP_DIR.match(latest.name)
        older = [p for p in step_dirs(self.root) if p != latest and int(STEP_DIR.match(p.name).group(1)) < int(m.group(1))]
        keep = {latest, *older[max(0, len(older) - (self.keep_last - 1)):]} if self.keep_last > 1 else {latest}
        for p in step_dirs(self.root):
            if p not in keep:  # older ones past keep_last, and newer ones no pointer leads to
                shutil.rmtree(p, ignore_errors=True)

    # ------------------------------------------------------------------ load
    def load_training_state(self, path: Path, zero: StateFragments) -> dict:
        """fp32 master weights and AdamW moments into this rank's ZeRO fragments (any saved layout),
        the model's parameters refreshed from them, the optimiser step count, RNG; returns state.json."""
        path = Path(path)
        state = json.loads((path / "state.json").read_text())
        check_files_present(path)
        if self.verify_on_load:
            from fbt_megatron.checkpoint.guards import verify_checksums

            verify_checksums(path)
        check_shapes(path, zero.specs, what_to_do="; a run resumes only with the model it was trained with: set "
                     "the recipe's model and feedback sections back to the run's (fbt ckpt inspect shows them), "
                     "or use a new run_dir")
        _load_fragments(path, zero.fragments())
        zero.masters_to_model()
        zero.set_optimizer_step(int(state["optimizer_steps"]))
        rng_file = path / "rng" / f"rank_{dist.get_rank():05d}.json"
        if rng_file.exists() and state.get("world_size") == dist.get_world_size():
            set_rng_state(json.loads(rng_file.read_text()))
        return state
