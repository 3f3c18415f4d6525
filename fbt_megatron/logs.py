"""How ``fbt_megatron`` reports: the standard :mod:`logging` module, rank-aware.

Progress and diagnostics go to loggers under ``fbt_megatron`` and ``data_pipeline`` (stderr);
results meant for pipes (tables, JSON, generated text, the training summary) stay on stdout.
``fbt [-q | -v | --log-level LEVEL] [--log-all-ranks] COMMAND`` calls :func:`setup`: by default only
rank 0 of a process group reports (``RANK`` from torchrun, or the initialised process group);
``--log-all-ranks`` lets every rank report, each line prefixed with its rank. Warnings and errors are
reported on every rank.
"""

from __future__ import annotations

import logging
import os
import sys

ROOTS = ("fbt_megatron", "data_pipeline")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def rank() -> int:
    """This process's rank: the initialised process group's, else torchrun's ``RANK``, else 0."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


class RankFilter(logging.Filter):
    """Lets INFO and below through on rank 0 only (unless ``all_ranks``); warnings pass everywhere."""

    def __init__(self, all_ranks: bool = False):
        super().__init__()
        self.all_ranks = all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = rank()
        return self.all_ranks or record.levelno >= logging.WARNING or record.rank == 0


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record (pytest's capture, a redirect)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def setup(level: str | int = "INFO", *, all_ranks: bool = False) -> None:
    """Configure the project's loggers (idempotent: a second call replaces the first's handler)."""
    if isinstance(level, str):
        if level.upper() not in LEVELS:
            raise ValueError(f"log level {level!r} is not one of {', '.join(LEVELS)}")
        level = getattr(logging, level.upper())
    verbose = level <= logging.DEBUG
    fmt = "%(message)s"
    if verbose:
        fmt = "%(asctime)s %(levelname)s %(name)s: " + fmt
    if all_ranks:
        fmt = "[rank %(rank)s] " + fmt
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(fmt))
    handler.addFilter(RankFilter(all_ranks))
    for name in ROOTS:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if getattr(h, "_fbt", False)]:
            logger.removeHandler(old)
        handler._fbt = True
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False


def printer(logger: logging.Logger, level: int = logging.INFO):
    """A ``print``-shaped function (``sep``/``flush``/``file`` accepted) that logs at ``level``: for
    code that takes a ``print_fn``/``log`` callable (tests pass their own)."""

    def emit(*args, sep: str = " ", **_ignored) -> None:
        logger.log(level, sep.join(str(a) for a in args))

    return emit
