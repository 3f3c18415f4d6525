"""Typed configuration of the data pipeline: the recipe's ``data:`` section.

``DataConfig`` is embedded by the trainer's recipe. Unknown keys are forbidden and every validation
error names the offending field (pydantic reports the location, e.g. ``sources.1.weight``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class SourceConfig(BaseModel):
    """One source of the token mix: a prepared dataset directory (holding ``index.json``) and its weight.

    ``weight / sum(weights)`` is this source's share of the stream's *tokens* (``weight_by: tokens``, the
    default) or of its *documents* (``weight_by: documents``); see ``data_pipeline.stream``.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="The source's name in logs, metrics and checkpoints; unique.")
    path: str = Field(min_length=1, description="A prepared dataset directory (it holds index.json).")
    weight: float = Field(gt=0, description="This source's share of the stream: weight / sum of weights.")


class DataConfig(BaseModel):
    """The ``data:`` section of a recipe."""

    model_config = ConfigDict(extra="forbid")

    sources: list[SourceConfig] = Field(min_length=1, description="The datasets of the token mix.")
    tokenizer: str = Field(
        min_length=1, description="A sentencepiece .model, a tokenizer.json, or a directory holding either.")
    seq_length: int = Field(ge=1, description="Tokens per row (set from the recipe's data.seq_length).")
    seed: int = Field(0, description="Seed of the shuffle and the mix's draws: the data order.")
    weight_by: Literal["tokens", "documents"] = Field(
        "tokens", description="What the weights share out: tokens (what a mix usually states) or documents.")
    num_workers: int = Field(0, ge=0, description="Loader worker processes per rank.")
    allow_skip_corrupt: bool = Field(
        False, description="Skip a shard that fails its check and mask a corrupt sample, counting both; "
        "false raises, naming the file.")
    valid_documents: int | None = Field(
        None, ge=0, description="Held-out documents per source, the last of its index (None: min(200, 5 %); "
        "0: no validation split).")

    @field_validator("sources")
    @classmethod
    def _unique_names(cls, sources: list[SourceConfig]) -> list[SourceConfig]:
        names = [s.name for s in sources]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"source names must be unique; duplicated: {dup}")
        return sources

    @model_validator(mode="after")
    def _positive_total(self):
        if sum(s.weight for s in self.sources) <= 0:  # pragma: no cover - each weight is > 0 already
            raise ValueError("sources: weights must sum to a positive number")
        return self

    @property
    def weights(self) -> list[float]:
        total = sum(s.weight for s in self.sources)
        return [s.weight / total for s in self.sources]
