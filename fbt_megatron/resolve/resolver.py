"""Recipe + world size + environment -> :class:`~fbt_megatron.resolve.plan.RunPlan`, in one pure step.

No process group, no torch.distributed, no Megatron state: it reads files (the tokenizer, the data
sources' indexes, the run's checkpoints) and writes none, so ``fbt train --dry-run``, ``fbt slurm
submit`` and every rank at start-up get the same plan. Every check that can run before launch runs
here, in this order, and all problems are reported at once (:class:`PlanError`):

1. the recipe: ``task``, ``init_from``'s model/feedback sections (resolve/sft.py);
2. the layout against the world size, the batch, the precision (recipe.check_layout);
3. the data: the embedded mix's section, the tokenizer against ``model.vocab_size``, each source's
   documents against ``valid_documents``, the chat template (SFT: chat datasets, document-causal attention);
4. the checkpoint to resume, the network it was trained with (recipe.check_checkpoint_model) and the
   rule adopted from it (recipe.adopt_checkpoint_rule); for a new run, the files it would replace in
   ``run_dir`` (``summary.json``, ``metrics.jsonl``) must be an earlier run's, not the user's;
5. what the run derives: feedback depth, validation passes, warnings.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fbt_megatron.recipe import (Recipe, RecipeError, adopt_checkpoint_rule, bf16_accumulation_warning,
                                 check_checkpoint_model, check_layout)
from fbt_megatron.resolve.plan import (DataPlan, Environment, Layout, PlanError, ResumePlan, RunPlan,
                                       nothing_to_train)
from fbt_megatron.resolve.sft import chat_template, check_sft_layout, resolve_init_sections


def resolve_run(recipe: Recipe, world_size: int, env: Environment | None = None, *,
                task: str | None = None, data_files: bool = True) -> RunPlan:
    """The plan of ``recipe`` run by ``world_size`` processes on ``env`` (default: this machine);
    ``task`` (``fbt sft``) sets the recipe's task. Raises :class:`PlanError` listing every problem.
    ``recipe`` is not changed: the plan holds a resolved copy. ``data_files=False`` (``fbt plan``, sizing
    a run where its data is not): the tokenizer and the sources are named, not read."""
    env = env or Environment.here()
    problems: list[str] = []

    def check(fn, *args):
        try:
            return fn(*args)
        except RecipeError as e:
            problems.append(str(e))
            return None

    recipe = recipe.model_copy(deep=True)
    if task is not None and recipe.task != task:
        recipe.task = task
    recipe = check(resolve_init_sections, recipe) or recipe

    # -- layout, batch, precision
    dp = check(check_layout, recipe, world_size)
    p = recipe.parallel
    layout = Layout(world_size, p.tensor, p.pipeline, dp or 0, p.zero_stage, p.sequence_parallel)
    precision = recipe.precision if recipe.precision != "auto" else env.dtype

    # -- data
    problems += check_sft_layout(recipe)
    missing = _missing_sources(recipe) if data_files else []  # one problem each; their indexes are not read
    data = check(_data_plan, recipe, data_files, not missing) or DataPlan(recipe.data.source, None, None, {}, None)
    problems += missing

    # -- the checkpoint resumed and the rule it was trained with
    resume, adopted = check(_resume, recipe) or (None, None)
    if data_files and not missing and resume is not None and resume.checkpoint is not None and data.config is not None:
        changed, fingerprints = _changed_data(recipe, data.config, resume.checkpoint)
        problems += changed
        data = dataclasses.replace(data, fingerprints=fingerprints)
    if resume is not None and resume.checkpoint is None:
        problems += _files_not_ours(recipe)
    total_steps = min(recipe.train.steps, recipe.train.stop_at_step or recipe.train.steps)
    done = (nothing_to_train(recipe.resolved_run_dir(), resume.step, recipe.train)
            if resume is not None and resume.checkpoint is not None else None)
    warnings = [w for w in (bf16_accumulation_warning(recipe, precision), adopted, done) if w]

    if problems:
        raise PlanError(problems)
    from fbt_megatron.passes import PassSchedule

    deepest = PassSchedule.of(recipe.schedule, recipe.feedback).max_passes
    depth = recipe.eval.feedback_passes or deepest
    eval_passes = [1] if recipe.feedback.fusion == "off" else recipe.eval.passes or [1, depth]
    return RunPlan(
        recipe=recipe, layout=layout, micro_batches_per_step=recipe.accumulation_steps(dp), precision=precision,
        data=data, resume=resume, feedback_depth=depth, eval_passes=tuple(eval_passes), max_passes=deepest,
        total_steps=total_steps,
        warnings=tuple(warnings))


def _data_plan(recipe: Recipe, read_files: bool = True, read_sources: bool = True) -> DataPlan:
    """The data pipeline's config (the embedded mix's section when the recipe names no sources), the
    tokenizer checked against ``model.vocab_size``, the held-out counts against the sources, the
    checkpoint's tokenizer files, the chat template. ``data.seq_length`` sets the pipeline's row length:
    a different ``data.pipeline.seq_length`` is refused rather than silently replaced."""
    d = recipe.data
    if d.source != "pipeline":
        return DataPlan(d.source, None, None, {}, None)
    from data_pipeline import embedded
    from data_pipeline.config import DataConfig
    from data_pipeline.errors import DataError
    from data_pipeline.tokenizer import load_tokenizer, tokenizer_files

    build = None
    if d.pipeline is None:
        build = d.embedded_dir
        section = embedded.embedded_section(d.embedded_dir)
    else:
        section = dict(d.pipeline)
        if section.get("seq_length", d.seq_length) != d.seq_length:
            raise RecipeError(f"recipe key 'data.pipeline.seq_length': {section['seq_length']!r} differs from "
                              f"data.seq_length ({d.seq_length}), which sets the rows' length; drop it or set "
                              f"data.seq_length")
    fixed = {"seq_length": d.seq_length} | ({"seed": d.seed} if d.seed is not None else {})  # data.seed: the order
    config = DataConfig.model_validate(dict(section, **fixed))
    tokenizer = Path(config.tokenizer)
    if not read_files:
        return DataPlan(d.source, config.model_dump(mode="json"), build, {}, None)
    if build is not None and not tokenizer.is_file():  # built at start-up with the default vocabulary
        files, vocab, template = {"tokenizer.model": str(tokenizer)}, embedded.VOCAB_SIZE, None
    else:
        try:
            files = {name: str(path) for name, path in tokenizer_files(config.tokenizer).items()}
            vocab = load_tokenizer(config.tokenizer).get_piece_size()
        except DataError as e:
            raise RecipeError(f"recipe key 'data.pipeline.tokenizer': {e}") from None
        template = chat_template(recipe, config) if read_sources else None
        if read_sources:
            _check_held_out(config)
    if vocab > recipe.model.vocab_size:
        raise RecipeError(f"recipe key 'model.vocab_size': {recipe.model.vocab_size} is smaller than the "
                          f"tokenizer's vocabulary ({vocab})")
    return DataPlan(d.source, config.model_dump(mode="json"), build, files, template)


def _check_held_out(config) -> None:
    """``data.pipeline.valid_documents`` against each source's document count, as the loader checks it at
    start-up: a dry run names the key. A dataset that does not open is left to the loader's own error."""
    from data_pipeline.errors import DataError
    from data_pipeline.loader import held_out_documents
    from data_pipeline.shards import Dataset

    if config.valid_documents is None:
        return
    try:
        datasets = [Dataset.load(s.path, allow_skip_corrupt=config.allow_skip_corrupt) for s in config.sources]
    except DataError:
        return
    try:
        held_out_documents(config, datasets)
    except DataError as e:
        raise RecipeError(f"recipe key 'data.pipeline.valid_documents': {e}") from None


def _missing_sources(recipe: Recipe) -> list[str]:
    """One problem per dataset directory of ``data.pipeline.sources`` that does not exist."""
    sources = (recipe.data.pipeline or {}).get("sources") if recipe.data.source == "pipeline" else None
    problems = []
    for i, source in enumerate(sources if isinstance(sources, list) else []):
        path = source.get("path") if isinstance(source, dict) else None
        if path and not Path(path).is_dir():
            problems.append(f"recipe key 'data.pipeline.sources[{i}].path': the dataset directory {path} of source "
                            f"{source.get('name')!r} does not exist (prepare it with `fbt data prepare --out DIR`)")
    return problems


def _changed_data(recipe: Recipe, data_config: dict, checkpoint: Path) -> tuple[list[str], dict | None]:
    """The resumed checkpoint's datasets against today's (their fingerprints): one problem when the data
    changed and ``checkpoint.allow_data_change`` is off; and today's fingerprints, which the plan carries so
    that training does not read every dataset's index a second time."""
    from data_pipeline.config import DataConfig
    from data_pipeline.errors import DataError
    from fbt_megatron.checkpoint.discovery import read_checkpoint_state
    from fbt_megatron.data.fingerprint import check_resume_data, data_fingerprints, trained_on_synthetic

    state = read_checkpoint_state(checkpoint)
    saved, from_synthetic = (state.get("data") or {}).get("fingerprints"), trained_on_synthetic(state)
    try:
        now = data_fingerprints(DataConfig.model_validate(data_config))
        check_resume_data(str(checkpoint), saved, now, recipe.checkpoint.allow_data_change,
                          from_synthetic=from_synthetic)
    except DataError as e:  # a changed dataset (or data source), or an index that cannot be read
        key = "data.source" if from_synthetic else "data.pipeline"
        return [f"recipe key {key!r}: {e}"], None
    return [], now


def _files_not_ours(recipe: Recipe) -> list[str]:
    """A new run rewrites ``summary.json`` and ``metrics.jsonl`` in its ``run_dir``: one problem if either
    there is not an earlier ``fbt train``'s, told by its content. A resumed run's folder, holding its
    checkpoints, is its own: nothing there is checked."""
    from data_pipeline.output_dir import OutputDirError, check_own_files, first_json_line_with, json_object_with

    recognisers = {"summary.json": json_object_with("run_dir", "step", "total_steps", "pass_counts"),
                   # a step's row, or an event's (validation, a data change); every row has its step and time
                   "metrics.jsonl": first_json_line_with("step", "time", any_of=("data_checksum", "event"),
                                                         prefixes=('{"step": ', '{"event": '))}
    try:
        check_own_files(recipe.resolved_run_dir(), recognisers, writer="fbt train", option="recipe key 'run_dir':",
                        instead="a new run_dir")
    except OutputDirError as e:
        return [str(e)]
    return []


def _no_checkpoint_to_continue(run_dir: Path, latest: Path) -> str:
    """The refusal of ``checkpoint.resume: required`` without ``latest``: a relative run_dir missing from
    this directory was most likely meant from another one; a new run from saved weights takes init_from."""
    new_run = "for a new run from a checkpoint's weights, add init_from=CHECKPOINT checkpoint.resume=true"
    if not run_dir.is_absolute() and not run_dir.exists():
        return (f"recipe key 'checkpoint.resume': the recipe continues a checkpoint, but {run_dir} does not exist "
                f"in {Path.cwd()}: run it from the directory that holds {run_dir}, or set run_dir to its full path; "
                f"{new_run}")
    return f"recipe key 'checkpoint.resume': the recipe continues a checkpoint, but {latest} does not exist; {new_run}"


def _resume(recipe: Recipe) -> tuple[ResumePlan, str | None]:
    """The run's latest checkpoint (``checkpoint.resume``), the feedback rule adopted from it, and
    ``init_from`` (weights only) when there is none; a new run never mixes into an older run's checkpoints."""
    from fbt_megatron.checkpoint.discovery import (LATEST, CheckpointError, read_checkpoint_state, resolve_checkpoint,
                                                   step_dirs)

    root = recipe.resolved_run_dir() / "checkpoints"
    has = (root / LATEST).exists() or (root.is_dir() and bool(step_dirs(root)))
    if not recipe.checkpoint.resume:
        if has:  # pruning and `latest` would interleave the two runs' checkpoints
            raise RecipeError(f"recipe key 'checkpoint.resume': checkpoint.resume=false, but {root} already holds "
                              f"checkpoints; choose another run_dir or remove {root}")
        return ResumePlan(None, (), recipe.init_from), None
    if not (root / LATEST).exists():
        if recipe.checkpoint.resume == "required":
            raise RecipeError(_no_checkpoint_to_continue(recipe.resolved_run_dir(), root / LATEST))
        return ResumePlan(None, (), recipe.init_from), None
    try:
        latest = resolve_checkpoint(root)
        state = read_checkpoint_state(latest)
        saved, step = state.get("recipe", {}), int(state.get("train_state", {}).get("step", 0))
    except (CheckpointError, OSError, ValueError) as e:
        raise RecipeError(f"recipe key 'run_dir': cannot resume: {e}") from None
    check_checkpoint_model(recipe, saved, latest)
    before = recipe.feedback.model_dump()
    message = adopt_checkpoint_rule(recipe, saved, latest)  # sets the adopted fields on recipe.feedback
    after = recipe.feedback.model_dump()
    adopted = tuple(f"feedback.{k}={after[k]!r}" for k in after if after[k] != before[k])
    return ResumePlan(latest, adopted, None, step), message
