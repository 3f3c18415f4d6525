"""User errors: one sentence, once per job, no traceback.

Anything that raises :class:`UserError` (or a subclass: ``RecipeError``, ``DataError``, ``CheckpointError``,
``ConversionError``, ...) reaches the ``fbt`` command's top level, which calls :func:`report`: rank 0
prints ``fbt COMMAND: error: MESSAGE`` on stderr, other ranks print nothing, and the exit status is 2.
An ``OSError`` about a named file that the user can fix (missing, not a directory, read-only, no
permission, no space) is reported the same way. ``fbt -v`` prints the traceback before the sentence.
Why: a traceback per rank buries a cause the user can fix in lines they cannot act on.
"""

from __future__ import annotations

import errno
import logging
import sys
import traceback
from pathlib import Path

from data_pipeline.errors import UserError

__all__ = ["UserError", "USAGE_EXIT", "DIVERGED_EXIT", "report", "user_error_message"]

USAGE_EXIT = 2  # the exit status of a user error (argparse's for a usage error)
DIVERGED_EXIT = 3  # fbt train stopped on non-finite losses (train.max_nonfinite_in_row)

# OSErrors a user fixes (a path, a permission, the disk), not a defect of the program
USER_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC,
               errno.EEXIST, errno.ENOTEMPTY, errno.ENAMETOOLONG, errno.EDQUOT}


def user_error_message(err: BaseException) -> str | None:
    """The sentence for ``err`` if it is a user error (a :class:`UserError`, or an OSError naming a file
    with one of ``USER_ERRNOS``); None for anything else (a defect: its traceback is wanted)."""
    if isinstance(err, UserError):
        return str(err)
    if isinstance(err, OSError) and err.filename is not None and err.errno in USER_ERRNOS:
        where = f"{err.filename}" + (f" -> {err.filename2}" if err.filename2 is not None else "")
        blocker = _file_in_the_way(str(err.filename)) if err.errno in (errno.EEXIST, errno.ENOTDIR) else None
        if blocker is not None:
            return f"{where} is a file, not a directory" if blocker == str(err.filename) else \
                f"{where}: {blocker} is a file, not a directory"
        return f"{where}: {err.strerror or errno.errorcode.get(err.errno, err.errno)}"
    return None


def _file_in_the_way(path: str) -> str | None:
    """The path itself or its nearest existing ancestor, if that is not a directory (a directory
    cannot be made under it)."""
    p = Path(path)
    for q in (p, *p.parents):
        if q.exists() or q.is_symlink():
            return None if q.is_dir() else str(q)
    return None


def _rank() -> int:
    from fbt_megatron.logs import rank

    return rank()


def _verbose() -> bool:
    return logging.getLogger("fbt_megatron").isEnabledFor(logging.DEBUG)


def report(prog: str, err: BaseException, *, message: str | None = None, stream=None) -> int:
    """Print ``err`` as ``PROG: error: MESSAGE`` on rank 0 only (with its traceback first under ``-v``,
    i.e. when the project's logger is at DEBUG) and return the exit status of a user error."""
    stream = stream or sys.stderr
    if _rank() != 0:
        return USAGE_EXIT
    if _verbose():
        traceback.print_exception(err, file=stream)
    text = message if message is not None else (user_error_message(err) or str(err))
    print(f"{prog}: error: {text}", file=stream, flush=True)
    return USAGE_EXIT
