"""Writing a file so that a kill never leaves it half-written.

A study's report, a run's ``summary.json`` and a run's cached read-outs are read back by later runs
(``--reuse`` resumes from them); a kill in the middle of an ordinary write would leave a truncated file
where the previous, complete one was.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

TEMPORARY = ".*.[0-9]*.tmp"  # the name of the temporary file a killed write leaves behind (fnmatch: .NAME.PID.tmp)


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path``: into a temporary file beside it (this process's own), flushed to disk,
    then renamed over ``path`` (atomic on POSIX), so a reader sees the old file or the new one, never a
    part of either; a file it replaces keeps its mode. A write killed outright leaves ``.NAME.PID.tmp``
    beside ``path`` (:data:`TEMPORARY`)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            shutil.copymode(path, tmp)  # its readers keep reading it
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def new_file_mode() -> int:
    """The mode ``open()`` gives a new file under this process's umask (``0o666 & ~umask``): for a file a
    library wrote with a narrower one (safetensors >= 0.8 writes ``0o600`` whatever the umask). The umask is
    read from ``/proc/self/status``; elsewhere it is set and restored, briefly as ``0o077`` (a file another
    thread makes meanwhile is private, never wider open)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return 0o666 & ~mask
