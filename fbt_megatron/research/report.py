"""Markdown tables, JSON and matplotlib figures for ``docs/results/`` (no display needed)."""

from __future__ import annotations

import json
import math
import platform
import time
from pathlib import Path

import numpy as np


def mean_std(values) -> tuple[float, float]:
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=float)
    if v.size == 0:
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def fmt(mean: float, std: float | None = None, digits: int = 3) -> str:
    if not math.isfinite(mean):
        return "n/a"
    return f"{mean:.{digits}f}" if std is None else f"{mean:.{digits}f} ± {std:.{digits}f}"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def provenance(command: str, seconds: float) -> str:
    return (f"_Produced by `{command}` on {time.strftime('%Y-%m-%d')} "
            f"({platform.processor() or platform.machine()}, torch CPU) in {seconds / 60:.1f} min._")


def save(out_dir: Path, stem: str, markdown: str, data: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.md").write_text(markdown.rstrip() + "\n")
    (out_dir / f"{stem}.json").write_text(json.dumps(data, indent=1, default=float))
    return out_dir / f"{stem}.md"


def figure(ncols: int = 1, width: float = 5.0, height: float = 3.6):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, axes[0]
