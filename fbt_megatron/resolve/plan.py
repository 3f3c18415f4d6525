"""The resolved run plan: what a recipe becomes for one launch, before any process starts.

:func:`fbt_megatron.resolve.resolver.resolve_run` makes it; ``train.run.build`` constructs the run from
it; ``fbt train --dry-run`` prints it (:meth:`RunPlan.to_yaml`). A recipe that cannot run raises
:class:`PlanError` with every problem found, each naming its recipe key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from fbt_megatron.recipe import Recipe, RecipeError


class PlanError(RecipeError):
    """Every problem of a recipe found before launch, one line each (as pydantic's ValidationError)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        n = len(self.problems)
        # one problem is one sentence (the CLI prints it on its error line); several are listed below a count
        super().__init__(self.problems[0] if n == 1 else f"invalid run plan ({n} errors):\n  " + "\n  ".join(self.problems))


@dataclass(frozen=True)
class Environment:
    """What a launch runs on: ``device`` ``cuda`` or ``cpu``; ``dtype`` what ``precision: auto`` means there."""
    device: str = "cpu"
    dtype: str = "fp32"

    @classmethod
    def here(cls) -> "Environment":
        """This machine (``FBT_DEVICE``, ``FBT_DTYPE`` as ``runtime`` reads them)."""
        from fbt_megatron import runtime

        return cls("cuda" if runtime.use_cuda() else "cpu", runtime.default_dtype_name())

    @classmethod
    def nodes(cls, gpu: bool) -> "Environment":
        """The compute nodes of a job submitted from here (a login node may have no GPU)."""
        import os

        forced = os.environ.get("FBT_DTYPE", "").lower()
        return cls("cuda" if gpu else "cpu", forced if forced in ("bf16", "fp32") else ("bf16" if gpu else "fp32"))


@dataclass(frozen=True)
class Layout:
    world_size: int
    tensor: int
    pipeline: int
    data: int  # data-parallel size
    zero_stage: int
    sequence_parallel: bool


@dataclass(frozen=True)
class DataPlan:
    source: str  # synthetic | pipeline
    config: dict | None  # the data pipeline's DataConfig (source=pipeline): tokenizer, sources, weights
    build_embedded: str | None  # the embedded mix's directory, built (idempotently) at start-up
    tokenizer_files: dict[str, str]  # name -> file: what every checkpoint carries
    chat_template: str | None  # the sources' chat template (SFT requires one)
    fingerprints: dict | None = None  # the datasets' fingerprints, when the plan read them to check a resume


@dataclass(frozen=True)
class ResumePlan:
    checkpoint: Path | None  # the run's own latest checkpoint, resumed
    adopted: tuple[str, ...]  # feedback.x=value taken from that checkpoint (the recipe does not set them)
    init_from: str | None  # weights only, when the run does not resume its own checkpoints
    step: int = 0  # the resumed checkpoint's step (0 for a new run)


@dataclass(frozen=True)
class RunPlan:
    recipe: Recipe  # every default filled, init_from's sections and the checkpoint's rule taken
    layout: Layout
    micro_batches_per_step: int  # per data-parallel rank: global batch / (micro batch x DP)
    precision: str  # bf16 | fp32
    data: DataPlan
    resume: ResumePlan
    feedback_depth: int  # passes of the deepest validation (and summary.json's val_loss_<k>pass)
    eval_passes: tuple[int, ...]
    max_passes: int  # the schedule's deepest step
    total_steps: int  # this invocation trains to here (train.stop_at_step or train.steps), from resume.step
    warnings: tuple[str, ...] = field(default_factory=tuple)

    @property
    def run_dir(self) -> Path:
        return self.recipe.resolved_run_dir()

    def derived(self) -> dict:
        """The values resolved from the recipe, by name (JSON types)."""
        r = self.recipe
        return {
            "run_dir": str(self.run_dir),
            "layout": vars(self.layout).copy(),
            "batch": {"global_batch_size": r.global_batch_size, "micro_batch_size": r.batch.micro_batch_size,
                      "micro_batches_per_step": self.micro_batches_per_step, "tokens_per_step": r.tokens_per_step},
            "precision": self.precision,
            "data": {"source": self.data.source, "build_embedded": self.data.build_embedded,
                     "tokenizer_files": dict(self.data.tokenizer_files),
                     "sources": [{"name": s["name"], "path": s["path"], "weight": s["weight"], "share": share}
                                 for s, share in zip(self.data.config["sources"], _shares(self.data.config))]
                     if self.data.config else [],
                     "chat_template": self.data.chat_template is not None},
            # without a fusion the schedule does not apply (one pass every step): its mix and switch are null
            "passes": {"mix": list(r.schedule.mix) if r.feedback.fusion != "off" else None,
                       "feedback_start_step": r.schedule.feedback_start_step if r.feedback.fusion != "off" else None,
                       "max_passes": self.max_passes, "feedback_depth": self.feedback_depth,
                       "eval_passes": list(self.eval_passes)},
            "steps": {"total": r.train.steps, "resumed_at": self.resume.step, "stops_at": self.total_steps,
                      "this_invocation": max(0, self.total_steps - self.resume.step)},
            "resume": {"checkpoint": str(self.resume.checkpoint) if self.resume.checkpoint else None,
                       "adopted": list(self.resume.adopted), "init_from": self.resume.init_from},
            "warnings": list(self.warnings),
        }

    def to_dict(self) -> dict:
        """``recipe``: a complete recipe (``fbt train`` reads it back); ``resolved``: what it resolves to."""
        return {"recipe": self.recipe.model_dump(mode="json"), "resolved": self.derived()}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=120)


def nothing_to_train(run_dir: Path, resumed_step: int, train) -> str | None:
    """The sentence for a run resumed at ``resumed_step`` that an invocation with ``train`` (the recipe's
    section) would not train, naming the limit or limits to raise; None if it trains."""
    steps, stop = train.steps, train.stop_at_step
    if resumed_step < min(steps, stop or steps):
        return None
    at_stop = stop is not None and resumed_step >= stop
    if at_stop and resumed_step < steps:
        return (f"{run_dir} is already at step {resumed_step}, at or past train.stop_at_step={stop}: nothing to "
                f"train (raise or remove train.stop_at_step)")
    if at_stop:
        return (f"{run_dir} is already at step {resumed_step} of {steps}, at or past train.stop_at_step={stop}: "
                f"nothing to train (raise train.steps, and raise or remove train.stop_at_step, to continue; or use a "
                f"new run_dir)")
    return (f"{run_dir} is already at step {resumed_step} of {steps}: nothing to train (raise train.steps to "
            f"continue, or use a new run_dir)")


def _shares(config: dict) -> list[float]:
    total = sum(s["weight"] for s in config["sources"])
    return [round(s["weight"] / total, 6) for s in config["sources"]]
