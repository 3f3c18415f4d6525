"""Checkpoint access for conversion: the one place that knows the checkpoint API.

Reading streams tensors out of the checkpoint's ``weights/`` (Megatron ``dist_checkpointing``,
torch_dist format) without building the model: each request names a tensor's global key and, for
stacked layer tensors, one layer's slice, and the reader assembles it from whatever TP shards were
saved (their global offsets are in the metadata). So the layout the checkpoint was saved with
(TP, PP, ZeRO) does not matter and at most one layer's tensors are in memory at a time.

Before reading, :meth:`CheckpointTensors.verify` checks the checkpoint against the tensors its recipe
implies: every key present with the expected global shape, every shard file the metadata refers to
present and long enough; errors name the file or key and the expected value.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from fbt_megatron.hf.mapping import ConversionError, Row, global_shape, shape_matches

WEIGHTS = "weights"


def resolve_checkpoint(path: str | Path) -> Path:
    """A run dir or its checkpoints dir (-> the checkpoint ``latest`` names) or a step dir."""
    from fbt_megatron.checkpoint import CheckpointError
    from fbt_megatron.checkpoint import resolve_checkpoint as resolve

    try:
        return resolve(path)
    except CheckpointError as err:
        raise ConversionError(str(err)) from None


class CheckpointTensors:
    def __init__(self, path: Path):
        from fbt_megatron.checkpoint.safe_load import install_safe_metadata_reader

        install_safe_metadata_reader()  # no arbitrary unpickling of the .metadata file
        self.path = Path(path)
        self.dir = self.path / WEIGHTS
        if not (self.dir / ".metadata").is_file():
            raise ConversionError(f"{self.dir / '.metadata'} is missing: not a torch_dist checkpoint")
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.metadata = FileSystemReader(str(self.dir)).read_metadata()
        self.shapes = {k: tuple(v.size) for k, v in self.metadata.state_dict_metadata.items()
                       if isinstance(v, TensorStorageMetadata)}

    # ------------------------------------------------------------------ checks
    def verify(self, rows: list[Row], num_layers: int) -> None:
        for row in rows:
            if row.key not in self.shapes:
                raise ConversionError(f"{self.dir}: tensor {row.key!r} is missing; the recipe's model needs it "
                                      f"with shape {global_shape(row, num_layers)}")
            if not shape_matches(row, self.shapes[row.key], num_layers):
                raise ConversionError(f"{self.dir}: tensor {row.key!r} has shape {self.shapes[row.key]}, the "
                                      f"recipe's model expects {global_shape(row, num_layers)} (-1: >= vocab)")
        known = {r.key for r in rows}
        extra = sorted(k for k in self.shapes if not k.startswith("optimizer.") and k not in known)
        if extra:  # a parameter the mapping does not know would be silently dropped
            raise ConversionError(f"{self.dir}: tensors {extra} have no Hugging Face mapping "
                                  "(fbt_megatron/hf/mapping.py weight_rows)")
        wanted = known
        for index, info in self.metadata.storage_data.items():
            if index.fqn not in wanted:
                continue
            shard = self.dir / info.relative_path
            if not shard.is_file():
                raise ConversionError(f"checkpoint shard {shard} is missing (it holds part of {index.fqn!r})")
            size = shard.stat().st_size
            if size < info.offset + info.length:
                raise ConversionError(f"checkpoint shard {shard} is truncated: {size} bytes, the metadata "
                                      f"expects at least {info.offset + info.length} (part of {index.fqn!r})")

    # ------------------------------------------------------------------ reading
    def read(self, requests: list[tuple[Row, int | None]], num_layers: int) -> list[torch.Tensor]:
        """Global fp32 tensors for (row, layer) pairs (layer None: a whole non-layer tensor)."""
        import torch.distributed.checkpoint as dcp

        buffers, slices = {}, {}
        for row, layer in requests:
            shape = self.shapes[row.key]
            if layer is None:
                buffers[row.key] = torch.empty(shape, dtype=torch.float32)
                slices[row.key] = (0,) * len(shape)
            else:  # one slice of the stacked [num_layers, ...] tensor
                buffers[row.key] = torch.empty((1, *shape[1:]), dtype=torch.float32)
                slices[row.key] = (layer,) + (0,) * (len(shape) - 1)
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                dcp.load(buffers, storage_reader=dcp.FileSystemReader(str(self.dir)), planner=_SlicePlanner(slices),
                         no_dist=True)
        except Exception as exn:  # a shard whose bytes do not match its metadata, unreadable files
            keys = sorted(buffers)
            raise ConversionError(f"cannot read {keys} from {self.dir}: {type(exn).__name__}: {exn}") from exn
        return [buffers[row.key][0] if layer is not None else buffers[row.key] for row, layer in requests]


def _slice_planner_class():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class SlicePlanner(DefaultLoadPlanner):
        """torch DCP's planner, reading each destination tensor from a region of the stored global
        tensor (``offsets``) instead of the whole of it; DCP picks the saved chunks (TP shards) that
        overlap it and reads only those bytes."""

        def __init__(self, offsets: dict):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.offsets = offsets

        def create_local_plan(self):
            items = []
            for fqn, tensor in self.state_dict.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(self.offsets[fqn]), sizes=tensor.size())
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk])
            return LoadPlan(items)

        def lookup_tensor(self, index):  # the destination is a plain tensor covering the region
            return self.state_dict[index.fqn]

    return SlicePlanner


def _SlicePlanner(offsets: dict):
    return _slice_planner_class()(offsets)


def load_framework_model(checkpoint: str | Path):
    """The checkpoint's FBT model at the current (world-of-one) parallel layout, weights loaded, in eval
    mode: the reference the parity tests compare an export against. Call inside a process group."""
    from fbt_megatron.checkpoint.model import load_checkpoint_model

    return load_checkpoint_model(checkpoint)[0]


def save_initial_checkpoint(run_dir: Path, model, recipe) -> Path:
    """Save a freshly built (TP=1) model as step 0 of ``run_dir`` with the trainer's own checkpoint
    manager and a fresh optimiser (zero AdamW moments), so ``fbt train`` resumes it in any layout."""
    from fbt_megatron.checkpoint import CheckpointManager
    from fbt_megatron.checkpoint.shards import StateFragments, param_specs
    from fbt_megatron.engine import Engine
    from fbt_megatron.checkpoint.state import CheckpointState
    from fbt_megatron.passes import PassSchedule
    from fbt_megatron.train.trainer import TrainState

    specs = param_specs(model)  # before DeepSpeed wraps the model (ZeRO-3 empties parameters)
    engine = Engine(model, recipe)
    state = CheckpointState(train_state=TrainState(), pass_schedule=PassSchedule.of(recipe.schedule, recipe.feedback),
                            recipe=recipe,
                            layout={"tensor": 1, "pipeline": 1, "data": 1, "zero_stage": recipe.parallel.zero_stage})
    return CheckpointManager(Path(run_dir) / "checkpoints").save(0, StateFragments(engine, specs), state.state_dict())
