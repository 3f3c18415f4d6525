"""Reading raw documents from sources: JSONL files (a text field), plain-text files and directories.

A document is ``(doc_id, text)``. Order is deterministic: paths as given, directories walked in
sorted order. A missing path raises :class:`SourceError` naming it; a bad JSONL line raises naming the
file and line number. Empty documents are not yielded here but counted by the caller (see
``iter_documents(..., counts=...)``) so nothing is dropped silently.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path

from .errors import SourceError

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".ndjson")
DEFAULT_TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".c", ".h", ".js", ".json", ".toml", ".yaml", ".yml")


def _is_jsonl(path: Path) -> bool:
    return any(path.name.endswith(s) for s in JSONL_SUFFIXES)


def expand_paths(paths: list[str], text_suffixes: tuple[str, ...] = DEFAULT_TEXT_SUFFIXES) -> list[Path]:
    """Files behind ``paths`` (files as given; directories walked, sorted, filtered by suffix)."""
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise SourceError(f"source path does not exist: {p}")
        if p.is_dir():
            found = []
            for root, dirs, names in os.walk(p):
                dirs.sort()
                for n in sorted(names):
                    f = Path(root) / n
                    if _is_jsonl(f) or f.suffix in text_suffixes:
                        found.append(f)
            if not found:
                raise SourceError(f"source directory holds no readable files ({', '.join(text_suffixes)}, jsonl): {p}")
            files.extend(found)
        else:
            files.append(p)
    return files


def iter_documents(
    paths: list[str],
    *,
    text_field: str = "text",
    id_field: str | None = "id",
    counts: dict | None = None,
    text_suffixes: tuple[str, ...] = DEFAULT_TEXT_SUFFIXES,
) -> Iterator[tuple[str, str]]:
    """Yield ``(doc_id, text)`` for every non-empty document. ``counts['empty']`` counts skipped empties."""
    counts = counts if counts is not None else {}
    counts.setdefault("empty", 0)
    counts.setdefault("files", 0)
    for f in expand_paths(paths, text_suffixes):
        counts["files"] += 1
        if _is_jsonl(f):
            opener = gzip.open if f.name.endswith(".gz") else open
            try:
                with opener(f, "rt", encoding="utf-8") as fh:
                    for lineno, line in enumerate(fh, 1):
                        if not line.strip():
                            continue
                        try:
                            rec = json.loads(line)
                        except json.JSONDecodeError as exn:
                            raise SourceError(f"{f}:{lineno}: invalid JSON ({exn.msg})") from exn
                        if not isinstance(rec, dict) or text_field not in rec:
                            raise SourceError(f"{f}:{lineno}: record has no text field {text_field!r}")
                        text = rec[text_field]
                        if not isinstance(text, str):
                            raise SourceError(f"{f}:{lineno}: field {text_field!r} is not a string")
                        doc_id = str(rec[id_field]) if id_field and id_field in rec else f"{f.name}:{lineno}"
                        if not text.strip():
                            counts["empty"] += 1
                            continue
                        yield doc_id, text
            except (OSError, UnicodeDecodeError, EOFError) as exn:
                raise SourceError(f"cannot read source file {f}: {exn}") from exn
        else:
            try:
                text = f.read_text(encoding="utf-8", errors="replace")
            except OSError as exn:
                raise SourceError(f"cannot read source file {f}: {exn}") from exn
            if not text.strip():
                counts["empty"] += 1
                continue
            yield str(f), text
