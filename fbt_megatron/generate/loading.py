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
    """The run's tokenizer, loaded: ``override``, else :func:`checkpoint.discovery.run_tokenizer`'s (the
    checkpoint's copy, an import's, or the recipe's path); None when none is known (synthetic data)."""
    from data_pipeline.tokenizer import load_tokenizer
    from fbt_megatron.checkpoint.discovery import run_tokenizer

    found = override or run_tokenizer(checkpoint, recipe)
    return None if found is None else load_tokenizer(found)


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
