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

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)
    weight: float = Field(gt=0)


class DataConfig(BaseModel):
    """The ``data:`` section of a recipe."""

    model_config = ConfigDict(extra="forbid")

    sources: list[SourceConfig] = Field(min_length=1)
    tokenizer: str = Field(min_length=1)  # a sentencepiece .model, a tokenizer.json, or a directory of either
    seq_length: int = Field(ge=1)
    seed: int = 0
    # What the sources' weights share out: "tokens" (default; what a mix usually states) or "documents".
    weight_by: Literal["tokens", "documents"] = "tokens"
    num_workers: int = Field(0, ge=0)
    # When True, a shard that fails the structural check at build time is excluded (logged, counted in
    # the loader's stats) and a sample whose bytes are corrupt is replaced by a loss-masked EOS run of
    # the same length (logged, counted). When False (default) either raises, naming the file.
    allow_skip_corrupt: bool = False
    # Held-out validation documents per source: the last ``valid_documents`` sample ids of each source's
    # index (by position in ``index.json``, so every rank, worker and resume agrees). The ``train``
    # split never reads them; the ``valid`` split reads only them. ``None`` (default) = automatic:
    # ``min(200, ceil(5% of the source))`` for a source of >= 2 documents, 0 for a single-document one.
    # ``0`` disables the split (the ``valid`` split then refuses to build). An explicit count must
    # leave every source at least one training document.
    valid_documents: int | None = Field(None, ge=0)

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
