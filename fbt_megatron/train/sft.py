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

The rules an SFT recipe is resolved and checked by before launch live in ``fbt_megatron/resolve/sft.py``;
this module constructs from the resolved plan.
"""

from __future__ import annotations

from pathlib import Path

from data_pipeline.chat import TEMPLATE_FILE
from fbt_megatron.files import write_text_atomic


def checkpoint_files(data_plan, run_dir: Path, rank: int) -> dict | None:
    """The files every checkpoint carries (the plan's tokenizer files), plus ``chat_template.jinja`` for a
    run on chat data (written by rank 0 into ``run_dir/checkpoints/``, the project's own folder: a user's
    file in the run directory is never in the way)."""
    files = {name: Path(path) for name, path in data_plan.tokenizer_files.items()} or None
    template = data_plan.chat_template
    if template is None:
        return files
    path = Path(run_dir) / "checkpoints" / TEMPLATE_FILE
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_text() != template:
            write_text_atomic(path, template)  # a kill mid-write leaves the old file, not a cut one
    return dict(files or {}, **{TEMPLATE_FILE: path})


def init_weights(init_from: str | None, model, log, verify: bool = True) -> None:
    """``init_from`` (the plan's: None when the run resumes its own checkpoints): load the checkpoint's
    weights into the bare model (before DeepSpeed wraps it, so the fp32 masters start from them);
    nothing else of it is read. ``verify``: check the files' checksums first (checkpoint.verify_on_load)."""
    if not init_from:
        return
    from fbt_megatron.checkpoint.manager import load_model_weights

    path = load_model_weights(init_from, model, verify=verify, use="init_from")
    log(f"initialised from {path} (weights only: new optimiser, LR schedule and data cursor)")
