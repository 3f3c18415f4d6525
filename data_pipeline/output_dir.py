"""The rule for every directory a command writes: never delete what the project did not write.

A command may write into an absent path or an empty directory. It may replace (or keep) a directory only
when that directory holds an earlier output of the same command: one of its marker files, and every entry
one that the command writes. Anything else is refused, naming the path and what it holds. The caller
decides what to do with its own earlier output (keep it when it is the same, replace it when asked).

A command that writes a few named files into a directory that may hold other things (a run directory,
an evaluation folder) uses :func:`check_own_files` instead: a file there under one of its names must be
one it wrote, recognised by its content.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from fnmatch import fnmatchcase
from pathlib import Path

from .errors import DataError


class OutputDirError(DataError):
    """An output path holds something the project did not write: nothing is changed."""


def describe(entries: list[str], limit: int = 4) -> str:
    """``a, b and c`` (past ``limit``: ``a, b, c, d and 2 more``): the first names of a directory listing,
    directories marked with ``/``."""
    if len(entries) > limit:
        return ", ".join(entries[:limit]) + f" and {len(entries) - limit} more"
    if len(entries) < 2:
        return "".join(entries)
    return ", ".join(entries[:-1]) + " and " + entries[-1]


def _them(entries: list) -> str:
    return "it" if len(entries) == 1 else "them"


def _entries(path: Path) -> list[str]:
    return sorted(e.name + ("/" if e.is_dir() else "") for e in os.scandir(path))


def earlier_output(path: str | os.PathLike, *, markers: tuple[str, ...], patterns: tuple[str, ...], writer: str,
                   option: str = "--out") -> bool:
    """Whether ``path`` holds an earlier output of ``writer`` (a marker present, every entry matching one of
    ``patterns``): False for an absent path or an empty directory, free to write. Anything else raises
    :class:`OutputDirError` naming ``path`` and what it holds."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return False
    if not path.is_dir():
        raise OutputDirError(f"{option} {path} is a file, not a directory: nothing was changed; choose a new or "
                             f"empty directory")
    entries = _entries(path)
    if not entries:
        return False
    foreign = [e for e in entries if not any(fnmatchcase(e.rstrip("/"), p) for p in patterns)]
    if foreign or not any((path / m).exists() for m in markers):
        shown = foreign or entries
        raise OutputDirError(f"{option} {path} holds {describe(shown)}, which {writer} did not write: nothing was "
                             f"changed; choose a new or empty directory, or move {_them(shown)} away")
    return True


def replace_dir(src: Path, dst: Path, *, markers: tuple[str, ...], patterns: tuple[str, ...], writer: str,
                option: str = "--out") -> None:
    """Move the finished directory ``src`` to ``dst``; an earlier output of ``writer`` at ``dst`` is replaced
    (moved aside first, removed after the move), anything else there is refused as :func:`earlier_output`
    refuses it (checked again here: it may have appeared while ``src`` was written)."""
    src, dst = Path(src), Path(dst)
    if earlier_output(dst, markers=markers, patterns=patterns, writer=writer, option=option):
        aside = dst.with_name(f".{dst.name}.replaced-{os.getpid()}")
        os.replace(dst, aside)
        os.replace(src, dst)
        shutil.rmtree(aside)
    else:
        os.replace(src, dst)  # onto an absent path or an empty directory


def check_own_files(path: str | os.PathLike, recognisers: dict[str, Callable[[Path], bool]], *, writer: str,
                    option: str = "--out", instead: str = "another directory") -> None:
    """Raise :class:`OutputDirError` if directory ``path`` holds a file named in ``recognisers`` that its
    recogniser does not take for ``writer``'s own (one it cannot read is not its own); nothing else in
    ``path`` matters. An absent ``path`` passes; a file at ``path`` is refused."""
    path = Path(path)
    if (path.exists() or path.is_symlink()) and not path.is_dir():
        raise OutputDirError(f"{option} {path} is a file, not a directory: nothing was changed; choose {instead}")
    foreign = []
    for name, recognise in recognisers.items():
        file = path / name
        if file.exists() or file.is_symlink():
            try:
                ours = file.is_file() and recognise(file)
            except (OSError, UnicodeDecodeError, ValueError):
                ours = False
            if not ours:
                foreign.append(name)
    if foreign:
        raise OutputDirError(f"{option} {path} holds {describe(sorted(foreign))}, which {writer} did not write: "
                             f"nothing was changed; choose {instead}, or move {_them(foreign)} away")


def json_object_with(*keys: str) -> Callable[[Path], bool]:
    """A recogniser: the file is one JSON object holding every one of ``keys``."""
    def recognise(file: Path) -> bool:
        value = json.loads(file.read_text())
        return isinstance(value, dict) and all(k in value for k in keys)
    return recognise


def first_json_line_with(*keys: str, any_of: tuple[str, ...] = (),
                         prefixes: tuple[str, ...] = ()) -> Callable[[Path], bool]:
    """A recogniser of a JSON-lines file written by appending: empty, or its first line an object holding
    every one of ``keys`` (and one of ``any_of`` if given), or (a first write cut by a kill) one
    unterminated line starting with one of ``prefixes``."""
    def recognise(file: Path) -> bool:
        with open(file, encoding="utf-8") as f:
            first = f.readline()
        if not first:
            return True
        if not first.endswith("\n"):
            return first.startswith(prefixes) if prefixes else False
        value = json.loads(first)
        return (isinstance(value, dict) and all(k in value for k in keys)
                and (not any_of or any(k in value for k in any_of)))
    return recognise
