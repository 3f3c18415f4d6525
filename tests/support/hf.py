"""Helpers for the conversion tests (picklable entry points for run_distributed, the HF-side script)."""

from __future__ import annotations


def train_recipes(recipes: list[dict]) -> list[dict]:
    """Train several tiny recipes one after the other in the same (distributed) processes."""
    from tests.support.training import train_fn

    return [{k: v for k, v in train_fn(r).items() if k in ("checkpoint", "step", "pass_counts")} for r in recipes]
