"""Errors of the data pipeline. Each message names the file (or path) concerned.

:class:`UserError` is the root of every error a user can fix (bad input, a missing file, a bad value),
for the whole project: ``fbt`` prints its message as one sentence and exits 2 (``fbt -v`` adds the
traceback; see ``fbt_megatron.errors``). It lives here, in the lowest layer, so that the data pipeline
stays free of ``fbt_megatron`` imports.
"""

from __future__ import annotations


class UserError(Exception):
    """A cause the user can fix. The message is one sentence naming the file and the key concerned."""


class DataError(UserError):
    """Base class: bad input to the data pipeline."""


class SourceError(DataError):
    """A source path is missing, unreadable or holds no documents."""


class EmptySourceError(SourceError):
    """A source yields no document: every one is empty (or was skipped as a bad row)."""


class CorruptShardError(DataError):
    """A shard is truncated, unreadable or its content does not match its index."""


class TokenizerMismatchError(DataError):
    """The tokenizer does not match the one a dataset (or a loader state) was built with."""


class IndexError_(DataError):
    """A dataset directory has no (or an unreadable) index."""


class OutOfSpaceError(DataError):
    """The disk filled while writing: the message names the path, the space free and what was kept."""
