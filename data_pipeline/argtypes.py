"""Bounded number types for argparse flags: every numeric flag of ``fbt`` names its range.

    p.add_argument("--top-p", type=number(float, gt=0, le=1), default=1.0)

A value out of range is argparse's usage error (one line naming the flag, exit 2). Each type keeps its
bounds in ``.bounds`` (tests/unit/test_cli_bounds.py walks every parser and asserts each numeric flag
has them). Why: a silent ``--workers 0`` or ``--shard-mb -1`` does something nobody asked for.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

_WORDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def number(kind: type = int, *, gt=None, ge=None, lt=None, le=None) -> Callable[[str], int | float]:
    """An argparse ``type`` parsing ``kind`` (int or float) within the given bounds (finite floats only)."""
    bounds = {k: v for k, v in (("gt", gt), ("ge", ge), ("lt", lt), ("le", le)) if v is not None}
    if not bounds:
        raise ValueError("number() needs at least one bound")
    text = " and ".join(f"{_WORDS[k]} {v}" for k, v in bounds.items())

    word = "an integer" if kind is int else "a number"

    def parse(value: str):
        try:
            x = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not {word}") from None
        finite = kind is int or math.isfinite(x)
        if not (finite and all({"gt": x > v, "ge": x >= v, "lt": x < v, "le": x <= v}[k] for k, v in bounds.items())):
            raise argparse.ArgumentTypeError(f"must be {word} {text} (got {value})")
        return x

    parse.__name__ = f"{word} {text}"  # argparse names the type in "invalid ... value" errors
    parse.bounds = bounds
    return parse


positive_int = number(int, ge=1)  # the most common bound, named
non_negative_int = number(int, ge=0)
