"""The rules an instruction-tuning recipe (``task: sft``; train/sft.py) resolves by before launch:
``init_from`` supplies the sections it omits, its data must be chat datasets with one chat template,
and packed conversations must not attend to each other."""

from __future__ import annotations

from fbt_megatron.recipe import Recipe, RecipeError


def resolve_init_sections(recipe: Recipe) -> Recipe:
    """A recipe with ``init_from`` that sets no ``model`` (or ``feedback``) section takes the checkpoint's,
    so an SFT recipe need not repeat the architecture. When the run resumes its own checkpoints, the
    sections come from its latest one: ``init_from`` is then not read (it may be gone)."""
    if not recipe.init_from:
        return recipe
    if {"model", "feedback"} <= recipe.model_fields_set:
        return recipe
    from fbt_megatron.checkpoint.discovery import LATEST, CheckpointError, read_checkpoint_state
    from fbt_megatron.config import saved_feedback_section
    from fbt_megatron.recipe import load_recipe

    own = recipe.resolved_run_dir() / "checkpoints"
    resuming = recipe.checkpoint.resume and (own / LATEST).exists()
    try:
        saved = read_checkpoint_state(own if resuming else recipe.init_from).get("recipe") or {}
    except (CheckpointError, OSError) as e:
        raise RecipeError(f"recipe key {'run_dir' if resuming else 'init_from'!r}: {e}") from None
    data = recipe.model_dump(mode="json", exclude_unset=True)
    taken = []
    if "model" not in recipe.model_fields_set and saved.get("model"):
        data["model"] = saved["model"]
        taken.append("model")
    if "feedback" not in recipe.model_fields_set and saved.get("feedback"):
        data["feedback"] = saved_feedback_section(saved["feedback"])
        taken.append("feedback")
    if not taken:
        return recipe
    return load_recipe(data=data)


def check_sft_layout(recipe: Recipe) -> list[str]:
    """What a ``task: sft`` recipe must hold in its own keys (the problems, each naming its key)."""
    if recipe.task != "sft":
        return []
    problems = []
    if recipe.data.source != "pipeline" or not recipe.data.pipeline:
        problems.append("recipe key 'data.pipeline': task=sft trains on chat datasets; give data.source=pipeline "
                        "and data.pipeline.sources prepared with `fbt data prepare --format chat`")
    if recipe.model.attention_mask != "document_causal":
        problems.append(f"recipe key 'model.attention_mask': task=sft packs conversations, which must not attend "
                        f"to each other; allowed: document_causal (got {recipe.model.attention_mask!r})")
    return problems


def chat_template(recipe: Recipe, data_config) -> str | None:
    """The run's chat template (from its data sources' indexes); SFT requires one, from every source."""
    if data_config is None:
        return None
    from data_pipeline.chat import ChatError, sources_chat_template

    try:
        return sources_chat_template(data_config, require=recipe.task == "sft")
    except ChatError as e:
        raise RecipeError(f"recipe key 'data.pipeline.sources': {e}") from None
