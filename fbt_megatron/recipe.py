"""The training recipe: one typed schema, validated before any process group starts.

``fbt train RECIPE.yaml [dotted.key=value ...]``: the YAML is read, overrides are applied by dotted
path (values parsed as YAML scalars), and the result is validated by :class:`Recipe`. Every section
forbids unknown keys; errors name the dotted path and, for unknown keys, the nearest valid name.
:func:`check_layout` then checks the parallel layout against the process count.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fbt_megatron.errors import UserError
from fbt_megatron.config import FeedbackConfig, ModelConfig, PassScheduleConfig, SyntheticDataConfig


class RecipeError(UserError, ValueError):
    """A recipe that cannot run; the message names the key."""


Beta = Annotated[float, Field(ge=0, lt=1)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ParallelConfig(Section):
    tensor: int = Field(1, ge=1, description="Tensor-parallel size (Megatron TP).")
    pipeline: int = Field(1, ge=1, description="Pipeline-parallel stages; must divide model.num_layers.")
    zero_stage: Literal[0, 1, 2, 3] = Field(1, description="DeepSpeed ZeRO stage over the data-parallel ranks.")
    sequence_parallel: bool = Field(
        False, description="Megatron sequence parallelism with tensor > 1; data.seq_length must divide by tensor.")
    grad_reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16 only: dtype of the data-parallel gradient reduction.")
    overlap_grad_reduce: bool = Field(
        True, description="bf16 at ZeRO-1 with data parallelism: start each bucket's all-reduce during backward.")
    grad_reduce_bucket_elements: int = Field(
        40_000_000, ge=1, description="overlap_grad_reduce: gradient elements per all-reduce bucket (Megatron's default).")


class BatchConfig(Section):
    """Global batch in sequences (or tokens); accumulation is derived from the DP size."""

    global_batch_size: int | None = Field(
        None, ge=1, description="Sequences per optimiser step (None: 4 x micro_batch_size, or from global_batch_tokens).")
    global_batch_tokens: int | None = Field(
        None, ge=1, description="Tokens per optimiser step, instead of global_batch_size; a multiple of seq_length.")
    micro_batch_size: int = Field(4, ge=1, description="Sequences per forward/backward on one data-parallel rank.")
    accumulation_steps: int | None = Field(
        None, ge=1, description="Micro-batches per step; derived from the DP size, checked against it if given.")


class OptimizerConfig(Section):
    lr: float = Field(1e-3, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay (norms, biases and h_init never decay).")
    betas: tuple[Beta, Beta] = Field((0.9, 0.95), description="AdamW betas, each in [0, 1).")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    grad_clip: float = Field(1.0, ge=0, description="Global gradient-norm clip; 0 disables clipping.")
    decay_embeddings: bool = Field(False, description="Decay the embeddings too (tied: also the LM head).")
    fusion_lr_multiplier: float = Field(
        1.0, gt=0, description="The fusion's W_U and W_G step at lr x this (Adam moves an entry by about lr a step).")


class LRScheduleConfig(Section):
    kind: Literal["cosine", "wsd", "constant"] = Field(
        "cosine", description="cosine decay, warmup-stable-decay (wsd), or constant after warmup.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="The final learning rate as a fraction of lr.")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd: the last fraction of steps that decays.")


class DataSection(Section):
    source: Literal["synthetic", "pipeline"] = Field(
        "synthetic", description="synthetic: generated data (data.synthetic); pipeline: prepared datasets.")
    seq_length: int = Field(64, ge=2, description="Tokens per training row.")
    synthetic: SyntheticDataConfig = Field(
        default_factory=SyntheticDataConfig, description="The generator's settings (source: synthetic).")
    pipeline: dict[str, Any] | None = Field(
        None, description="The data pipeline's sources, weights and tokenizer (source: pipeline; see data.pipeline.*).")
    embedded_dir: str = Field(
        "data/embedded", description="source: pipeline with no pipeline section: the embedded token mix, built "
        "offline here on first use.")
    valid_sequences: int = Field(64, ge=1, description="Held-out sequences read at each evaluation.")
    seed: int | None = Field(
        None, ge=0, description="The data order's seed, for either source: it replaces pipeline.seed and "
        "synthetic.seed (None keeps theirs). The recipe's seed sets the model, not the data.")


class TrainLoopConfig(Section):
    steps: int = Field(100, ge=1, description="The schedule's length in optimiser steps (LR decay, feedback switch).")
    stop_at_step: int | None = Field(None, ge=1, description="End this invocation early, at this step.")
    max_nonfinite_in_row: int = Field(5, ge=1, description="Stop after this many non-finite steps in a row.")
    collective_timeout_s: float = Field(
        600.0, gt=0, description="Seconds before a hung collective fails every rank, so torchrun restarts the group "
        "from latest; keep it above the longest healthy wait (data build, checkpoint write).")


class LoggingConfig(Section):
    log_every: int = Field(10, ge=1, description="Steps between log lines.")
    tensorboard: bool = Field(True, description="Write TensorBoard scalars under the run directory.")
    wandb: bool = Field(False, description="Log to Weights & Biases.")
    wandb_project: str = Field("fbt", description="The Weights & Biases project.")
    peak_flops: float | None = Field(None, gt=0, description="Peak FLOP/s per device, for the MFU estimate.")


class EvalConfig(Section):
    every: int = Field(50, ge=1, description="Steps between evaluations.")
    feedback_passes: int | None = Field(
        None, ge=1, description="Passes of the fed-back evaluation (None: the schedule's deepest pass count).")
    passes: list[int] | None = Field(
        None, description="Pass counts validated at each evaluation (None: 1 and feedback_passes).")

    @field_validator("passes")
    @classmethod
    def _passes(cls, v):
        if v is not None and (not v or any(k < 1 for k in v)):
            raise ValueError(f"eval.passes={v} must list pass counts >= 1")
        return v
    at_end: bool = Field(True, description="Evaluate once more after the last step.")


class CheckpointConfig(Section):
    every: int = Field(100, ge=1, description="Steps between checkpoints.")
    keep_last: int = Field(2, ge=1, description="Checkpoints kept; older ones are deleted.")
    async_save: bool = Field(False, description="Write checkpoints in the background.")
    at_end: bool = Field(True, description="Save a checkpoint after the last step.")
    resume: bool | Literal["required"] = Field(
        True, description="Resume from the run directory's latest checkpoint; 'required': refuse to start without "
        "one (a recipe that continues a checkpoint, such as fbt convert from-hf's).")

    @field_validator("resume", mode="before")
    @classmethod
    def _resume_value(cls, value):
        """One sentence for a value that is none of the three (the union would report each branch)."""
        if isinstance(value, bool) or value == "required":
            return value
        if type(value) is int and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ValueError(f"must be true, false or required, not {value!r}")
    verify_on_load: bool = Field(
        True, description="Check every checkpoint file's checksum before a resume or init_from loads it, as fbt ckpt "
        "verify does.")
    allow_data_change: bool = Field(
        False, description="Resume although a dataset's index changed since the checkpoint; the change is "
        "recorded in metrics.jsonl and the checkpoint.")


class ProfileConfig(Section):
    enabled: bool = Field(False, description="Record a torch profiler trace.")
    start_step: int = Field(5, ge=0, description="First profiled step.")
    num_steps: int = Field(3, ge=1, description="Profiled steps.")


class Recipe(Section):
    name: str = Field("run", description="The run's name (default run directory runs/NAME).")
    run_dir: str | None = Field(None, description="Where checkpoints, logs and metrics go (None: runs/NAME).")
    task: Literal["pretrain", "sft"] = Field(
        "pretrain", description="sft: instruction tuning on chat datasets (fbt sft).")
    init_from: str | None = Field(
        None, description="A run directory or checkpoint whose weights start this run (weights only).")
    seed: int = Field(1234, ge=0, description="Seed of the model's initialisation (and of the pass schedule, unless set).")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto: bf16 on GPU, fp32 on CPU; bf16: bf16 weights and activations, fp32 masters "
        "and gradient accumulation (DeepSpeed bf16).")
    model: ModelConfig = Field(default_factory=ModelConfig)
    feedback: FeedbackConfig = Field(default_factory=FeedbackConfig)
    schedule: PassScheduleConfig = Field(default_factory=PassScheduleConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = Field(default_factory=LRScheduleConfig)
    data: DataSection = Field(default_factory=DataSection)
    train: TrainLoopConfig = Field(default_factory=TrainLoopConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)

    @model_validator(mode="after")
    def _consistent(self):
        """Fill the derived defaults and check the sections against each other: every problem at once."""
        b, d = self.batch, self.data
        s = self.schedule
        if s._seed_follows_recipe or "seed" not in s.model_fields_set:
            s.seed, s._seed_follows_recipe = self.seed, True
        problems = []
        if b.global_batch_size is None and b.global_batch_tokens is None:
            b.global_batch_size = 4 * b.micro_batch_size
        if b.global_batch_tokens is not None:
            seqs = b.global_batch_tokens // d.seq_length
            if b.global_batch_tokens % d.seq_length:
                problems.append(f"batch.global_batch_tokens={b.global_batch_tokens} is not a multiple of "
                                f"data.seq_length={d.seq_length}")
            elif b.global_batch_size is not None and b.global_batch_size != seqs:
                problems.append(f"batch.global_batch_size={b.global_batch_size} contradicts "
                                f"batch.global_batch_tokens={b.global_batch_tokens} ({seqs} sequences)")
            else:
                b.global_batch_size = seqs
        if b.global_batch_size is not None and b.global_batch_size % b.micro_batch_size:
            problems.append(f"batch.global_batch_size={b.global_batch_size} is not divisible by "
                            f"batch.micro_batch_size={b.micro_batch_size}")
        if d.seq_length > self.model.max_sequence_length:
            problems.append(f"data.seq_length={d.seq_length} exceeds "
                            f"model.max_sequence_length={self.model.max_sequence_length}")
        if d.source == "pipeline" and d.pipeline is not None:
            from data_pipeline.config import DataConfig

            try:
                DataConfig.model_validate(dict(d.pipeline, seq_length=d.seq_length))
            except ValidationError as err:
                problems.append(format_validation_error(err, prefix="data.pipeline.", root=DataConfig))
        if d.source == "synthetic" and d.pipeline is not None:
            problems.append("data.pipeline is set but data.source is 'synthetic', which would ignore it; add "
                            "data.source=pipeline to train on it, or data.pipeline=null for synthetic data")
        if d.source == "synthetic" and d.synthetic.vocab_size > self.model.vocab_size:
            problems.append(f"data.synthetic.vocab_size={d.synthetic.vocab_size} exceeds "
                            f"model.vocab_size={self.model.vocab_size}")
        p = self.parallel
        if self.feedback.mixin == "bounded" and p.zero_stage == 3:
            problems.append("feedback.mixin='bounded' with parallel.zero_stage=3 is not supported (ZeRO-3 gathers "
                            "W_U only inside its own forward; the bound reads it before); allowed: zero_stage 0, 1, 2")
        if p.pipeline > 1:
            if self.model.num_layers % p.pipeline:
                problems.append(f"parallel.pipeline={p.pipeline} does not divide model.num_layers="
                                f"{self.model.num_layers}; allowed: divisors of num_layers")
            if p.zero_stage == 3:
                problems.append("parallel.zero_stage=3 is not supported with parallel.pipeline > 1; allowed: 0, 1, 2")
        try:
            self.model.check_tensor_parallel(self.parallel.tensor)
        except ValueError as e:
            problems.append(str(e))
        if problems:
            raise ValueError("\n  ".join(problems))  # one line each under "invalid recipe:"
        return self

    # ------------------------------------------------------------------ derived
    @property
    def global_batch_size(self) -> int:
        return int(self.batch.global_batch_size)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.data.seq_length

    def resolved_precision(self) -> str:
        if self.precision != "auto":
            return self.precision
        from fbt_megatron import runtime

        return runtime.default_dtype_name()

    def accumulation_steps(self, dp_size: int) -> int:
        return self.global_batch_size // (self.batch.micro_batch_size * dp_size)

    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / self.name


# ---------------------------------------------------------------------- loading
def _nearest(name: str, options, prefix: str = "") -> str:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.0)
    return f"; did you mean {prefix + match[0]!r}?" if match else ""


def _section_fields(loc: tuple, root=None) -> list[str]:
    """Valid field names of the section at ``loc`` (a pydantic error location)."""
    model: Any = root or Recipe
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
        args = [a for a in getattr(model, "__args__", ()) if hasattr(a, "model_fields")]
        if args:  # list[SourceConfig], X | None
            model = args[0]
    return list(getattr(model, "model_fields", {}))


def format_validation_error(err: ValidationError, prefix: str = "", root=None) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not isinstance(p, int))
        path = prefix + ".".join(str(p) for p in e["loc"]) or "<recipe>"
        if e["type"] == "extra_forbidden":
            dotted = prefix + "".join(f"{p}." for p in loc[:-1])
            hint = _nearest(str(loc[-1]), _section_fields(loc[:-1], root), dotted)
            lines.append(f"unknown recipe key {path!r}{hint}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            got = e.get("input")
            got = "" if isinstance(got, dict) or e["type"] in ("value_error",) else f" (got {got!r})"
            lines.append(f"recipe key {path!r}: {msg}{got}" if path != "<recipe>" else f"{msg}")
    if prefix:
        return "; ".join(lines)
    return "invalid recipe:\n  " + "\n  ".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise RecipeError(f"override {text!r} is not of the form dotted.key=value")
    key, value = text.split("=", 1)
    if not key:
        raise RecipeError(f"override {text!r} has no key")
    try:
        return key.split("."), yaml.safe_load(value) if value != "" else ""
    except yaml.YAMLError as err:  # often a value with spaces that the shell split into several words
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise RecipeError(f"override {text!r}: the value is not valid YAML ({problem}); when the value has "
                          f"spaces, quote the whole override, as in \"{text} ...\"") from None


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for i, part in enumerate(path[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            elif not isinstance(nxt, dict):
                raise RecipeError(f"override {text!r}: {'.'.join(path[:i + 1])!r} is not a section")
            node = nxt
        node[path[-1]] = value
    return data


def read_recipe_yaml(path: str | Path) -> Any:
    """The YAML document of a recipe file; a missing file or a syntax error is a :class:`RecipeError`
    naming the file and the line (yaml names only ``<unicode string>`` when given the text)."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe {path} does not exist" if not path.exists() else f"recipe {path} is not a file")
    try:
        with path.open(encoding="utf-8") as f:
            return yaml.safe_load(f) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = getattr(err, "problem", None) or str(err)
        context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
        if context and start is not None:
            what += f" ({context} at line {start.line + 1})"
        raise RecipeError(f"{where}: not valid YAML: {what}") from None
    except UnicodeDecodeError as err:
        raise RecipeError(f"{path}: not UTF-8 text (byte {err.start})") from None


def load_recipe(path: str | Path | None = None, overrides: list[str] | None = None,
                data: dict | None = None) -> Recipe:
    if data is None:
        data = {}
        if path is not None:
            data = read_recipe_yaml(path)
            if not isinstance(data, dict):
                raise RecipeError(f"recipe {path} must be a mapping of sections")
            data.setdefault("name", Path(path).stem)
    data = apply_overrides(dict(data), list(overrides or []))
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(format_validation_error(err)) from None


def load_saved_recipe(data: dict) -> Recipe:
    """The recipe saved in a checkpoint's state.json, read with the rules it was trained under (a
    checkpoint written before ``feedback.first_input`` existed used the ``state`` rule; one written before
    a ``data.pipeline`` beside synthetic data was refused trained without it: it is left out)."""
    from fbt_megatron.config import saved_feedback_section

    saved_data = data.get("data")
    if isinstance(saved_data, dict) and saved_data.get("source", "synthetic") == "synthetic":
        saved_data = {**saved_data, "pipeline": None}
    return load_recipe(data={**data, "feedback": saved_feedback_section(data.get("feedback")),
                             **({"data": saved_data} if saved_data is not None else {})})


# What a checkpoint was trained with that its resumption keeps: the pass-input rule and the
# stabilisers. A recipe that does not set one takes the checkpoint's (so a changed default never
# changes a run mid-way); one that sets another value is refused, except the training-only jitter.
TRAINED_FEEDBACK_FIELDS = ("first_input", "mixin", "prefix_mixin", "jitter_std")
TRAINING_ONLY_FIELDS = ("jitter_std",)


def adopt_checkpoint_rule(recipe: Recipe, saved: dict, where) -> str | None:
    """Resuming ``saved`` (a checkpoint's recipe dict) under ``recipe``: the pass-input rule and the
    stabilisers (``TRAINED_FEEDBACK_FIELDS``) are the checkpoint's. Those the recipe does not set are
    taken (returns a message saying which); one it sets otherwise is refused naming both, before
    anything is written (the jitter, training-only noise, may change)."""
    from fbt_megatron.config import saved_feedback_section

    if recipe.feedback.fusion == "off":  # without a fusion none of them means anything
        return None
    trained = saved_feedback_section(saved.get("feedback"))
    taken = []
    for name in TRAINED_FEEDBACK_FIELDS:
        if name not in trained or trained[name] == getattr(recipe.feedback, name):
            continue
        asked = getattr(recipe.feedback, name)
        if name in recipe.feedback.model_fields_set:
            if name in TRAINING_ONLY_FIELDS:
                continue
            raise RecipeError(
                f"recipe key 'feedback.{name}': the checkpoint {where} was trained with "
                f"feedback.{name}={trained[name]!r}, this recipe asks for {asked!r}; resuming would change what "
                f"the model computes. Set feedback.{name}={trained[name]} to continue it, or start a new run_dir")
        setattr(recipe.feedback, name, trained[name])
        taken.append(f"feedback.{name}={trained[name]!r}")
    if not taken:
        return None
    try:  # what the recipe's own checks refuse stays refused with the checkpoint's values in place
        Recipe.model_validate(recipe.model_dump())
    except ValidationError as err:
        raise RecipeError(f"the checkpoint {where} was trained with {', '.join(taken)}, which this recipe cannot "
                          f"run: {format_validation_error(err)}") from None
    return f"{', '.join(taken)} (what the checkpoint {where} was trained with; the recipe does not set it)"


# The model keys that make the network (its parameters, or what they compute): a run resumes only with the
# values it was trained with. Dropout, recomputation, the init and the positions' reach may change.
ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                       "activation", "add_bias_linear", "add_qkv_bias", "vocab_size", "position_embedding_type",
                       "normalization", "tie_embeddings")


def check_checkpoint_model(recipe: Recipe, saved: dict, where) -> None:
    """Resuming ``saved`` (a checkpoint's recipe dict): refuse a recipe whose network differs from the one the
    checkpoint was trained with, in :data:`ARCHITECTURE_FIELDS` (the positions' table too, for learned
    positions) or the fusion (its form; its bias where there is one), naming every such key; before launch,
    not after the job waited in a queue. Values are compared as the model uses them (an unset
    ``ffn_hidden_size`` is 4 x hidden, unset ``num_query_groups`` one per head)."""
    from fbt_megatron.config import ModelConfig, saved_feedback_section

    def effective(model: dict) -> dict:
        return {**model, "ffn_hidden_size": model["ffn_hidden_size"] or 4 * model["hidden_size"],
                "num_query_groups": model["num_query_groups"] or model["num_attention_heads"]}

    fields = ARCHITECTURE_FIELDS + (("max_sequence_length",) if recipe.model.position_embedding_type
                                    == "learned_absolute" else ())
    saved_model = saved.get("model") or {}
    try:  # an older checkpoint's section: what it lacks takes today's default
        trained = effective(ModelConfig(**{k: v for k, v in saved_model.items() if k in ModelConfig.model_fields})
                            .model_dump(mode="json"))
    except ValidationError:  # a section this version cannot read: the load's shape check still runs
        trained = None
    now = effective(recipe.model.model_dump(mode="json"))
    derived = {n for n in ("ffn_hidden_size", "num_query_groups")  # unset on both sides: follows the others
               if saved_model.get(n) is None and getattr(recipe.model, n) is None}
    changed = [(f"model.{n}", trained[n], now[n]) for n in fields
               if trained is not None and n in saved_model and n not in derived and trained[n] != now[n]]
    if saved.get("feedback") is not None:  # the fusion's form, and its bias where there is a fusion
        fb = saved_feedback_section(saved["feedback"])
        for n in ("fusion", "bias"):
            off = n == "bias" and fb.get("fusion", "off") == "off" and recipe.feedback.fusion == "off"
            if n in fb and fb[n] != getattr(recipe.feedback, n) and not off:
                changed.append((f"feedback.{n}", fb[n], getattr(recipe.feedback, n)))
    if not changed:
        return
    show = lambda v: yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()  # noqa: E731
    raise RecipeError(f"recipe key '{changed[0][0]}': the checkpoint {where} was trained with another network ("
                      + "; ".join(f"{key}: {show(old)} there, {show(new)} here" for key, old, new in changed)
                      + "), and a run resumes only with its own; set "
                      + " ".join(f"{key}={show(old)}" for key, old, _ in changed) + " to continue it, or use a new "
                      "run_dir")


def check_layout(recipe: Recipe, world_size: int) -> int:
    """Check the parallel layout and batch against ``world_size`` processes; return the DP size."""
    p = recipe.parallel
    model_parallel = p.tensor * p.pipeline
    if world_size % model_parallel:
        # the key to change is the one set above 1 (tensor when both are): its sizes that fit the processes
        key, other = ("parallel.pipeline", p.tensor) if p.tensor == 1 else ("parallel.tensor", p.pipeline)
        fits = [n for n in range(1, world_size + 1) if world_size % (n * other) == 0]
        raise RecipeError(
            f"recipe key '{key}': tensor={p.tensor} x pipeline={p.pipeline} does not divide the process count "
            f"{world_size}: one copy of the model takes {model_parallel} processes, so launch a multiple of "
            f"{model_parallel} (torchrun --nproc-per-node, fbt plan --gpus, fbt slurm submit --gpus-per-node)"
            + (f" or set {key} to one of {fits}" if fits else ""))
    dp = world_size // model_parallel
    per_step = recipe.batch.micro_batch_size * dp
    if recipe.global_batch_size % per_step:
        raise RecipeError(
            f"recipe key 'batch.global_batch_size': {recipe.global_batch_size} sequences is not divisible "
            f"by micro_batch_size={recipe.batch.micro_batch_size} x data-parallel size {dp}")
    acc = recipe.accumulation_steps(dp)
    if recipe.batch.accumulation_steps is not None and recipe.batch.accumulation_steps != acc:
        raise RecipeError(
            f"recipe key 'batch.accumulation_steps': {recipe.batch.accumulation_steps} does not match "
            f"global_batch_size / (micro_batch_size x DP) = {acc} at {world_size} processes")
    if p.sequence_parallel and p.tensor > 1 and recipe.data.seq_length % p.tensor:
        raise RecipeError(
            f"recipe key 'parallel.sequence_parallel': data.seq_length={recipe.data.seq_length} is not divisible "
            f"by parallel.tensor={p.tensor} (sequence parallelism splits the sequence over the TP ranks)")
    return dp


def bf16_accumulation_warning(recipe: Recipe, precision: str | None = None) -> str | None:
    """DeepSpeed 0.19 accumulates gradients in bf16 at ZeRO-0 and ZeRO-2 whatever the config asks
    (ZeRO-1 and 3 accumulate in fp32): said at the start of such a run. ``precision``: the resolved one
    (default: this machine's)."""
    p = recipe.parallel
    if (precision or recipe.resolved_precision()) == "bf16" and p.zero_stage in (0, 2):
        return (f"warning: parallel.zero_stage={p.zero_stage} with bf16 accumulates gradients in bf16 (DeepSpeed has "
                "no fp32 accumulation there); zero_stage 1 or 3 accumulate in fp32")
    return None
