"""Load a trained FBT model (and its tokenizer) for inference, in the current parallel layout.

A checkpoint stores every tensor with its tensor-parallel sharding metadata, so it loads under any
TP size: each rank reads the slice its layout needs. ``load_for_inference`` accepts a run directory
(its ``checkpoints/latest``), a ``checkpoints`` directory or one ``step_N`` directory.

The checkpoint package's public API (``fbt_megatron.checkpoint``: resolve_checkpoint,
read_checkpoint_state, load_model_weights) is used here only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from fbt_megatron.errors import UserError
from fbt_megatron import runtime
from fbt_megatron.config import FeedbackConfig, ModelConfig, saved_feedback_section


class CheckpointNotFound(UserError, FileNotFoundError):
    pass


# ---------------------------------------------------------------------- checkpoint access (one place)
def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A run dir -> its latest checkpoint; a ``checkpoints`` dir -> its latest; a step dir -> itself."""
    from fbt_megatron.checkpoint import CheckpointError
    from fbt_megatron.checkpoint import resolve_checkpoint as resolve

    try:
        return resolve(path)
    except CheckpointError as e:
        raise CheckpointNotFound(str(e)) from None


# ---------------------------------------------------------------------- model + tokenizer
@dataclass
class LoadedModel:
    model: torch.nn.Module
    model_config: ModelConfig
    feedback_config: FeedbackConfig
    checkpoint: Path
    tokenizer: object | None  # sentencepiece processor, None when not found


def ensure_runtime(tensor: int | None = None) -> None:
    """Start torch.distributed and Megatron's parallel state if the caller has not: a world of one,
    or under torchrun TP = WORLD_SIZE (generation has no data parallelism)."""
    from megatron.core import parallel_state

    runtime.init_distributed()
    if not parallel_state.model_parallel_is_initialized():
        import torch.distributed as dist

        runtime.init_parallel_state(runtime.ParallelLayout(tensor=tensor or dist.get_world_size()))


def find_tokenizer(recipe: dict, checkpoint: Path, override: str | None = None):
    """The run's tokenizer: ``override``, else the copy kept in the checkpoint
    (``tokenizer.json`` and its config files, or ``tokenizer.model``, written by every save of a run on tokenized data), else, for checkpoints from
    before that, the recipe's ``data.pipeline.tokenizer`` (a relative path is tried from the working
    directory, then from the checkpoint's parent directories)."""
    from data_pipeline.tokenizer import load_tokenizer

    if override:
        return load_tokenizer(override)
    if (checkpoint / "tokenizer.json").is_file():  # a Hugging Face tokenizer travels as its files
        return load_tokenizer(checkpoint)
    if (checkpoint / "tokenizer.model").is_file():
        return load_tokenizer(checkpoint / "tokenizer.model")
    name = ((recipe.get("data") or {}).get("pipeline") or {}).get("tokenizer")
    if not name:
        return None
    candidates = [Path(name)]
    if not Path(name).is_absolute():  # checkpoint = <repo>/runs/<name>/checkpoints/step_N
        candidates += [parent / name for parent in checkpoint.resolve().parents]
    for c in candidates:
        if c.is_file():
            return load_tokenizer(c)
    raise FileNotFoundError(f"the run's tokenizer {name} was not found (looked in {os.getcwd()} and the "
                            f"checkpoint's parent directories); pass --tokenizer PATH")


def load_for_inference(path: str | os.PathLike, *, tokenizer: str | None = None,
                       need_tokenizer: bool = True) -> LoadedModel:
    """Build the run's model for the current parallel layout, fill it from the checkpoint, eval mode."""
    from fbt_megatron.checkpoint import load_model_weights, read_checkpoint_state
    from fbt_megatron.checkpoint.discovery import check_given_tokenizer
    from fbt_megatron.generate.model import build_inference_model

    ckpt = resolve_checkpoint(path)
    if tokenizer is not None:  # before the model is built and loaded
        check_given_tokenizer(ckpt, tokenizer)
    state = read_checkpoint_state(ckpt)
    recipe = state.get("recipe")
    if not isinstance(recipe, dict) or "model" not in recipe:
        raise ValueError(f"{ckpt}/state.json has no 'recipe' with a 'model' section; cannot rebuild the model")
    model_cfg = ModelConfig.model_validate(recipe["model"])
    fb_cfg = FeedbackConfig.model_validate(saved_feedback_section(recipe.get("feedback")))
    ensure_runtime()
    model = build_inference_model(model_cfg, fb_cfg)
    load_model_weights(ckpt, model)
    tok = find_tokenizer(recipe, ckpt, tokenizer)
    if tok is None and need_tokenizer:
        raise FileNotFoundError(f"{ckpt}: the recipe names no tokenizer (synthetic data?); pass --tokenizer PATH")
    if tok is not None and tok.get_piece_size() > model_cfg.vocab_size:
        raise ValueError(f"tokenizer has {tok.get_piece_size()} pieces, more than model.vocab_size="
                         f"{model_cfg.vocab_size}")
    return LoadedModel(model.eval(), model_cfg, fb_cfg, ckpt, tok)
