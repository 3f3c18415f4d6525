"""Errors of the data pipeline. Each message names the file (or path) concerned."""

from __future__ import annotations


class DataError(Exception):
    """Base class: bad input to the data pipeline."""


class SourceError(DataError):
    """A source path is missing, unreadable or holds no documents."""


class CorruptShardError(DataError):
    """A shard is truncated, unreadable or its content does not match its index."""


class TokenizerMismatchError(DataError):
    """The tokenizer does not match the one a dataset (or a loader state) was built with."""


class IndexError_(DataError):
    """A dataset directory has no (or an unreadable) index."""


class OutOfSpaceError(DataError):
    """The disk filled while writing: the message names the path, the space free and what was kept."""
