"""Reading raw documents from sources: JSONL (plain, ``.gz``, ``.zst``), Parquet, a ``datasets`` save
directory (Arrow), plain-text files and directories of them.

A document is ``(doc_id, text)``. Order is deterministic: paths as given, directories walked in
sorted order, Parquet by row group, Arrow by record batch (each streamed: memory is bounded by one row
group or batch whatever the file's size). A missing path raises :class:`SourceError` naming it; a
missing text column, a corrupt file or a bad row (invalid JSON or UTF-8, no text field, a text that
is null or not a string) raises naming the file and the line (JSONL, 1-based) or row (Parquet and
Arrow, 0-based). With ``skip_bad_rows`` a bad row is skipped and counted instead (``counts['bad_rows']``,
the first one's message in ``counts['first_bad_row']``); a corrupt file or a missing column still
raises. Empty documents are not yielded but counted (``counts['empty']``) so nothing is dropped silently.

A ``datasets`` save (``Dataset.save_to_disk``) is read with pyarrow alone: its ``state.json`` lists the
Arrow stream files in order.

:func:`list_units` cuts the same stream into **units** (a JSONL or text file, a Parquet row group, one
Arrow file of a ``datasets`` save) that :func:`iter_units` reads one by one: the units of a list, read
in order, yield exactly what :func:`iter_documents` yields for the paths (ids and row numbers in error
messages included), so a job array can give each task a contiguous run of units (``array.py``).
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import SourceError

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
DEFAULT_TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".c", ".h", ".js", ".json", ".toml", ".yaml", ".yml")
DATASETS_STATE = "state.json"  # marks a `datasets` save directory (with dataset_info.json)


def _is_jsonl(path: Path) -> bool:
    return any(path.name.endswith(s) for s in JSONL_SUFFIXES)


def _is_parquet(path: Path) -> bool:
    return path.name.endswith(PARQUET_SUFFIXES)


def _is_datasets_save(path: Path) -> bool:
    return path.is_dir() and (path / DATASETS_STATE).is_file() and (path / "dataset_info.json").is_file()


def datasets_arrow_files(path: Path) -> list[Path]:
    """The Arrow files of a ``datasets`` save, in its order (``state.json``'s ``_data_files``)."""
    try:
        state = json.loads((path / DATASETS_STATE).read_text())
        files = [path / d["filename"] for d in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exn:
        raise SourceError(f"{path / DATASETS_STATE}: not a readable datasets save state ({exn})") from None
    for f in files:
        if not f.is_file():
            raise SourceError(f"{path}: Arrow file {f.name} listed in {DATASETS_STATE} is missing")
    return files


def expand_paths(paths: list[str], text_suffixes: tuple[str, ...] = DEFAULT_TEXT_SUFFIXES) -> list[Path]:
    """Sources behind ``paths``: files as given, a ``datasets`` save directory as one source, other
    directories walked (sorted, filtered by suffix)."""
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise SourceError(f"source path does not exist: {p}")
        if _is_datasets_save(p):
            files.append(p)
        elif p.is_dir() and (p / "dataset_dict.json").is_file():
            splits = sorted(d.name for d in p.iterdir() if _is_datasets_save(d))
            raise SourceError(f"{p} is a datasets DatasetDict: give one split's directory ({splits})")
        elif p.is_dir():
            found = []
            for root, dirs, names in os.walk(p):
                dirs.sort()
                for n in sorted(names):
                    f = Path(root) / n
                    if _is_jsonl(f) or _is_parquet(f) or f.suffix in text_suffixes:
                        found.append(f)
            if not found:
                raise SourceError(f"source directory holds no readable files ({', '.join(text_suffixes)}, "
                                  f"jsonl, jsonl.gz, jsonl.zst, parquet): {p}")
            files.extend(found)
        else:
            files.append(p)
    return files


def fingerprint_files(source: Path) -> list[Path]:
    """The files whose size and mtime identify a source (a datasets save: its Arrow files and state)."""
    return [source / DATASETS_STATE, *datasets_arrow_files(source)] if _is_datasets_save(source) else [source]


class _Rows:
    """Per-row checks shared by every format: a bad row raises, or is counted under ``skip``."""

    def __init__(self, counts: dict, skip: bool, text_field: str):
        self.counts, self.skip, self.field = counts, skip, text_field

    def bad(self, where: str, why: str) -> None:
        msg = f"{where}: {why}"
        if not self.skip:
            raise SourceError(msg + " (--skip-bad-rows skips and counts such rows)")
        self.counts["bad_rows"] += 1
        self.counts.setdefault("first_bad_row", msg)

    def text(self, where: str, value) -> str | None:
        """The row's text, or None (bad: raised or counted; empty: counted)."""
        if not isinstance(value, str):
            self.bad(where, f"field {self.field!r} is " + ("null" if value is None else f"not a string ({type(value).__name__})"))
            return None
        if not value.strip():
            self.counts["empty"] += 1
            return None
        return value


def _zst_lines(f: Path):
    """Lines of a ``.zst`` file, frame by frame through zstandard's decompressor; a file that ends inside
    a frame raises (zstandard's stream reader returns a short read there, silently)."""
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    obj, fed, tail = dctx.decompressobj(), False, b""
    with open(f, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            while chunk:
                fed = True
                *lines, tail = (tail + obj.decompress(chunk)).split(b"\n")
                yield from (line + b"\n" for line in lines)
                chunk = b""
                if obj.eof:  # the frame ended: the rest of the chunk starts the next one
                    chunk, obj, fed = obj.unused_data, dctx.decompressobj(), False
    if fed and not obj.eof:
        raise zstandard.ZstdError("the file ends inside a zstd frame (truncated)")
    if tail:
        yield tail


def _lines(f: Path):
    if f.name.endswith(".zst"):
        yield from _zst_lines(f)
        return
    with (gzip.open if f.name.endswith(".gz") else open)(f, "rb") as fh:
        yield from fh


def _jsonl(f: Path, rows: _Rows, text_field: str, id_field: str | None):
    import zstandard

    lineno = 0
    try:
        for lineno, raw in enumerate(_lines(f), 1):
            where = f"{f}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exn:
                rows.bad(where, f"not UTF-8 ({exn.reason} at byte {exn.start})")
                continue
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exn:
                rows.bad(where, f"invalid JSON ({exn.msg})")
                continue
            if not isinstance(rec, dict) or text_field not in rec:
                rows.bad(where, f"record has no text field {text_field!r}")
                continue
            text = rows.text(where, rec[text_field])
            if text is not None:
                yield (str(rec[id_field]) if id_field and id_field in rec else f"{f.name}:{lineno}"), text
    except (OSError, EOFError, zstandard.ZstdError) as exn:
        raise SourceError(f"cannot read source file {f} (after line {lineno}): {exn}") from exn


def _columns(f: Path, names: list[str], text_field: str, id_field: str | None) -> list[str]:
    if text_field not in names:
        raise SourceError(f"{f}: no column {text_field!r} (columns: {names}); choose one with --text-field")
    return [text_field] + ([id_field] if id_field and id_field in names and id_field != text_field else [])


def _table_rows(f: Path, batches, rows: _Rows, text_field: str, id_field: str | None, first_row: int = 0):
    """(doc_id, text) of record batches, rows numbered from ``first_row``."""
    row = first_row
    for batch in batches:
        texts = batch.column(text_field).to_pylist()
        ids = batch.column(id_field).to_pylist() if id_field and id_field in batch.schema.names else None
        for j, value in enumerate(texts):
            text = rows.text(f"{f} row {row + j}", value)
            if text is not None:
                yield (str(ids[j]) if ids is not None and ids[j] is not None else f"{f.name}:{row + j}"), text
        row += len(texts)


def _open_parquet(f: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(f)
    except (OSError, pa.ArrowException) as exn:
        raise SourceError(f"cannot read Parquet file {f}: {exn}") from exn


def _parquet(f: Path, rows: _Rows, text_field: str, id_field: str | None, groups: list[int] | None = None,
             first_row: int = 0):
    """Row groups ``groups`` (default: all) of ``f``, the first one's first row numbered ``first_row``."""
    import pyarrow as pa

    pf = _open_parquet(f)
    cols = _columns(f, pf.schema_arrow.names, text_field, id_field)
    row = first_row
    for g in (range(pf.num_row_groups) if groups is None else groups):
        try:
            table = pf.read_row_group(g, columns=cols)
        except (OSError, pa.ArrowException) as exn:
            raise SourceError(f"cannot read Parquet file {f}, row group {g} (rows from {row}): {exn}") from exn
        yield from _table_rows(f, table.to_batches(), rows, text_field, id_field, row)
        row += table.num_rows


def _datasets_save(d: Path, rows: _Rows, text_field: str, id_field: str | None, files: list[int] | None = None,
                   first_row: int = 0):
    """Arrow files ``files`` (indexes into ``state.json``'s list; default: all) of the save ``d``, the first
    one's first row numbered ``first_row`` (rows are numbered across the save's files)."""
    import pyarrow as pa

    row = first_row
    arrow = datasets_arrow_files(d)
    for f in (arrow if files is None else [arrow[k] for k in files]):
        try:
            with pa.memory_map(str(f)) as source:
                reader = pa.ipc.open_stream(source)
                _columns(f, reader.schema.names, text_field, id_field)
                for batch in reader:  # one record batch at a time
                    yield from _table_rows(f, [batch], rows, text_field, id_field, row)
                    row += batch.num_rows
        except (OSError, pa.ArrowException) as exn:
            raise SourceError(f"cannot read Arrow file {f} of the datasets save {d} (rows from {row}): {exn}") from exn


def iter_documents(
    paths: list[str],
    *,
    text_field: str = "text",
    id_field: str | None = "id",
    counts: dict | None = None,
    text_suffixes: tuple[str, ...] = DEFAULT_TEXT_SUFFIXES,
    skip_bad_rows: bool = False,
) -> Iterator[tuple[str, str]]:
    """Yield ``(doc_id, text)`` for every non-empty document (module docstring: formats, errors).
    ``counts``: ``empty`` and ``bad_rows`` skipped, ``files`` read."""
    counts = counts if counts is not None else {}
    for key in ("empty", "files", "bad_rows"):
        counts.setdefault(key, 0)
    rows = _Rows(counts, skip_bad_rows, text_field)
    for f in expand_paths(paths, text_suffixes):
        counts["files"] += 1
        if _is_datasets_save(f):
            yield from _datasets_save(f, rows, text_field, id_field)
        elif _is_parquet(f):
            yield from _parquet(f, rows, text_field, id_field)
        else:
            yield from _file(f, rows, text_field, id_field)


def _file(f: Path, rows: _Rows, text_field: str, id_field: str | None):
    """A JSONL file's documents, or a text file as one document."""
    if _is_jsonl(f):
        yield from _jsonl(f, rows, text_field, id_field)
        return
    try:
        text = f.read_text(encoding="utf-8", errors="replace")
    except OSError as exn:
        raise SourceError(f"cannot read source file {f}: {exn}") from exn
    if not text.strip():
        rows.counts["empty"] += 1
        return
    yield str(f), text


@dataclass(frozen=True)
class Unit:
    """A piece of the input read whole, in stream order: a JSONL or text file (``kind`` "file", ``part``
    -1), a Parquet row group (``part``: its number) or one Arrow file of a ``datasets`` save (``part``:
    its place in ``state.json``). ``first_row``: the number its first row has in its file or save (error
    messages and default ids); ``nbytes``: its size on disk (what slices are balanced by)."""

    source: str
    kind: str
    part: int
    first_row: int
    nbytes: int

    def as_dict(self) -> dict:
        return asdict(self)


def _arrow_rows(f: Path) -> int:
    import pyarrow as pa

    try:
        with pa.memory_map(str(f)) as source:  # batch headers only: the memory map reads no text
            return sum(batch.num_rows for batch in pa.ipc.open_stream(source))
    except (OSError, pa.ArrowException) as exn:
        raise SourceError(f"cannot read Arrow file {f}: {exn}") from exn


def list_units(paths: list[str], text_suffixes: tuple[str, ...] = DEFAULT_TEXT_SUFFIXES) -> list[Unit]:
    """The units of ``paths`` in stream order (module docstring). Reads Parquet footers and Arrow batch
    headers, no text; a corrupt footer or stream raises naming the file."""
    units: list[Unit] = []
    for src in expand_paths(paths, text_suffixes):
        if _is_datasets_save(src):
            row = 0
            for k, f in enumerate(datasets_arrow_files(src)):
                units.append(Unit(str(src), "arrow", k, row, f.stat().st_size))
                row += _arrow_rows(f)
        elif _is_parquet(src):
            meta, row = _open_parquet(src).metadata, 0
            for g in range(meta.num_row_groups):
                rg = meta.row_group(g)
                nbytes = sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))
                units.append(Unit(str(src), "parquet", g, row, nbytes))
                row += rg.num_rows
        else:
            units.append(Unit(str(src), "file", -1, 0, src.stat().st_size))
    return units


def iter_units(
    units: list[Unit],
    *,
    text_field: str = "text",
    id_field: str | None = "id",
    counts: dict | None = None,
    skip_bad_rows: bool = False,
) -> Iterator[tuple[str, str]]:
    """Yield ``(doc_id, text)`` of the units in order, as :func:`iter_documents` does for their paths
    (the same errors, skips and ``counts``, except ``files``)."""
    counts = counts if counts is not None else {}
    for key in ("empty", "bad_rows"):
        counts.setdefault(key, 0)
    rows = _Rows(counts, skip_bad_rows, text_field)
    for u in units:
        path = Path(u.source)
        if u.kind == "arrow":
            yield from _datasets_save(path, rows, text_field, id_field, files=[u.part], first_row=u.first_row)
        elif u.kind == "parquet":
            yield from _parquet(path, rows, text_field, id_field, groups=[u.part], first_row=u.first_row)
        elif u.kind == "file":
            yield from _file(path, rows, text_field, id_field)
        else:
            raise ValueError(f"unknown unit kind {u.kind!r}")
