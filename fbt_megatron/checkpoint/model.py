"""A checkpoint's model rebuilt from the recipe it saved: for tools, export and analysis."""

from __future__ import annotations

from pathlib import Path

from fbt_megatron.checkpoint.manager import load_model_weights, read_checkpoint_state, resolve_checkpoint


def load_checkpoint_model(run_dir_or_checkpoint: str | Path):
    """(model, recipe, checkpoint dir) from a run's latest checkpoint (or a step dir) saved in any
    layout, as a TP=1 eval-mode model. Call inside a world-of-one process group."""
    from fbt_megatron import runtime
    from fbt_megatron.model.fbt_gpt import build_model
    from fbt_megatron.recipe import load_saved_recipe

    path = resolve_checkpoint(run_dir_or_checkpoint)
    recipe = load_saved_recipe(read_checkpoint_state(path)["recipe"])
    recipe.parallel.tensor = 1
    runtime.init_parallel_state(runtime.ParallelLayout(), seed=recipe.seed)
    model = build_model(recipe.model, recipe.feedback)
    load_model_weights(path, model)
    return model.eval(), recipe, path
