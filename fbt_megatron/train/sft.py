"""Instruction tuning: ``fbt sft RECIPE`` (or ``task: sft`` in a recipe for ``fbt train``).

An SFT run is an ordinary training run (every parallel layout, checkpoint, resume and SLURM path of
``fbt train``) with three differences, all here:

* **Data.** Every source is a chat dataset (``fbt data prepare --format chat``): its conversations are
  packed like documents (``model.attention_mask: document_causal`` is required, so a packed
  conversation never attends to another), and the per-token loss mask the dataset stores (assistant
  tokens and their end-of-turn token) enters the batch's ``loss_mask`` in the loader, i.e. the one
  masked loss of ``train_step`` / the pipeline's last stage. The sources' chat template is written
  next to ``tokenizer.model`` in every checkpoint (``chat_template.jinja``), for ``fbt generate
  --chat`` and the HF export. A chat source without a template is refused by name.
* **Start.** ``init_from`` (a run directory or a checkpoint, e.g. one written by ``fbt convert
  from-hf``): its weights only, with a fresh optimiser, LR schedule and data cursor. When the SFT run's
  own directory already has checkpoints, they win (a resume mid-SFT continues exactly; ``init_from`` is
  then not read again). A recipe that sets no ``model``/``feedback`` section takes the checkpoint's.
* **Pass mix.** The recipe's ``schedule`` (default: the paper's 75/22/3 from step 0) applies to the
  SFT phase from its first step.
"""

from __future__ import annotations

from pathlib import Path

from data_pipeline.chat import TEMPLATE_FILE
from fbt_megatron.recipe import Recipe, RecipeError


def resolve_init_sections(recipe: Recipe) -> Recipe:
    """Before validation against the layout: a recipe with ``init_from`` that sets no ``model`` (or
    ``feedback``) section takes the checkpoint's, so an SFT recipe need not repeat the architecture.
    When the run resumes its own checkpoints, the sections come from its latest one: ``init_from`` is
    then not read (it may be gone)."""
    if not recipe.init_from:
        return recipe
    if {"model", "feedback"} <= recipe.model_fields_set:
        return recipe
    from fbt_megatron.checkpoint import CheckpointError
    from fbt_megatron.checkpoint.manager import LATEST, read_checkpoint_state
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


def check_sft(recipe: Recipe) -> None:
    """What an SFT recipe must hold (before anything runs); the message names the key."""
    if recipe.task != "sft":
        return
    if recipe.data.source != "pipeline" or not recipe.data.pipeline:
        raise RecipeError("recipe key 'data.pipeline': task=sft trains on chat datasets; give data.source=pipeline "
                          "and data.pipeline.sources prepared with `fbt data prepare --format chat`")
    if recipe.model.attention_mask != "document_causal":
        raise RecipeError(f"recipe key 'model.attention_mask': task=sft packs conversations, which must not attend "
                          f"to each other; allowed: document_causal (got {recipe.model.attention_mask!r})")
    chat_template(recipe)  # every source a chat dataset with its template (refused by name)


def chat_template(recipe: Recipe) -> str | None:
    """The run's chat template (from its data sources' indexes); SFT requires one, from every source."""
    if recipe.data.source != "pipeline" or not recipe.data.pipeline:
        return None
    from data_pipeline.chat import ChatError, sources_chat_template
    from fbt_megatron.data.loaders import data_pipeline_config

    try:
        return sources_chat_template(data_pipeline_config(recipe), require=recipe.task == "sft")
    except ChatError as e:
        raise RecipeError(f"recipe key 'data.pipeline.sources': {e}") from None


def checkpoint_files(recipe: Recipe, run_dir: Path, files: dict | None, rank: int) -> dict | None:
    """The files every checkpoint carries, plus ``chat_template.jinja`` for a run on chat data (written
    into the run directory by rank 0)."""
    template = chat_template(recipe)
    if template is None:
        return files
    path = Path(run_dir) / TEMPLATE_FILE
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_text() != template:
            path.write_text(template)
    return dict(files or {}, **{TEMPLATE_FILE: path})


def init_weights(recipe: Recipe, model, resuming: bool, log) -> None:
    """``init_from``: load the checkpoint's weights into the bare model (before DeepSpeed wraps it, so
    the fp32 masters start from them); nothing else of it is read. Not when the run resumes its own."""
    if not recipe.init_from or resuming:
        return
    from fbt_megatron.checkpoint.manager import load_model_weights

    path = load_model_weights(recipe.init_from, model, verify=recipe.checkpoint.verify_on_load)
    log(f"initialised from {path} (weights only: new optimiser, LR schedule and data cursor)")
