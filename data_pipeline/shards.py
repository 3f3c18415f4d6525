"""A prepared dataset on disk: WebDataset shards, their index, and random access into them.

A prepared dataset (index format version 2) is a directory::

    index.json          format, format_version, name, tokenizer hash, eos id, token dtype, counts
    shards.npy          int64 [num_shards, 4]: first_sample, num_samples, num_tokens, bytes
    lengths.npy         int32 [num_samples]  tokens of each document
    offsets.npy         int64 [num_samples]  byte offset of the document's first tar member in its shard
    crc32.npy           uint32 [num_samples] crc32 of the document's token bytes
    shard-000000.tar    WebDataset shards; sample key = global sample id (10 digits), members
    shard-000001.tar    ``<key>.json`` (source, doc_id, num_tokens) and ``<key>.tokens.npy`` (the tokens)

Why this layout: at 4x10^8 documents the per-document arrays are 6.4 GB. They are opened with
``mmap`` (``np.load(mmap_mode="r")``), so every rank and loader worker of a node shares one copy through
the page cache and touches only the pages of the documents it reads; start-up reads ``index.json`` and
``shards.npy`` (O(shards) bytes) and lists the directory once, with no per-shard ``stat``. A shard's size
is checked against the index when a reader first opens it (``fstat`` of the open file).

A document's bytes are found without scanning: ``shard = searchsorted(first_sample, id)``, then one
``pread`` of ``[offsets[id], offsets[id + 1])`` holds its tar members, parsed with :mod:`tarfile`'s header
reader. Format version 1 (``samples.npz``, shard list inside ``index.json``) is still read, eagerly, with a
warning; an unknown version is refused naming it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import tarfile
import weakref
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np

from .errors import CorruptShardError, IndexError_, TokenizerMismatchError

log = logging.getLogger(__name__)

FORMAT = "fbt-data"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
INDEX_FILE = "index.json"
SHARDS_FILE = "shards.npy"
ARRAY_FILES = {"lengths": "lengths.npy", "offsets": "offsets.npy", "crc32": "crc32.npy"}
LEGACY_SAMPLES_FILE = "samples.npz"  # format version 1
SHARD_COLUMNS = ("first_sample", "num_samples", "num_tokens", "bytes")


def sample_key(sid: int) -> str:
    return f"{sid:010d}"


def shard_name(i: int) -> str:
    return f"shard-{i:06d}.tar"


def index_version(index: dict, where) -> int:
    """The index format version; refuses anything this code does not read, naming the file."""
    fmt, ver = index.get("format"), index.get("format_version")
    if fmt == "fbt-data-v1" and ver is None:
        return 1
    if fmt != FORMAT or not isinstance(ver, int):
        raise IndexError_(f"{where}: not an fbt dataset index (format {fmt!r}, format_version {ver!r}); "
                          f"expected format {FORMAT!r} version {FORMAT_VERSION}")
    if ver not in READABLE_VERSIONS:
        newer = " (written by a newer fbt: upgrade this one)" if ver > FORMAT_VERSION else ""
        raise IndexError_(f"{where}: index format_version {ver} is not readable{newer}; this fbt reads "
                          f"versions {list(READABLE_VERSIONS)}")
    return ver


# ---------------------------------------------------------------------------------------------- read
_OPEN: "weakref.WeakValueDictionary[tuple, Dataset]" = weakref.WeakValueDictionary()


class Dataset:
    """A prepared dataset's metadata; per-document arrays are read-only memory maps.

    ``bad_shards``: shards found missing at load (only with ``allow_skip_corrupt``); their documents keep
    their places in the stream and are replaced by loss-masked spans, like any corrupt document.
    """

    def __init__(self, path: Path, index: dict, version: int, shard_table: np.ndarray, lengths, offsets, crc32,
                 bad_shards: dict[int, str], allow_skip_corrupt: bool):
        self.path, self.index, self.version = path, index, version
        self.shard_table = shard_table
        self.shard_first = np.ascontiguousarray(shard_table[:, 0])
        self.lengths, self.offsets, self.crc32 = lengths, offsets, crc32
        self.bad_shards = bad_shards
        self.allow_skip_corrupt = allow_skip_corrupt
        self._token_cum = np.concatenate([[0], np.cumsum(shard_table[:, 2])])

    # pickling (spawned loader workers) reopens the maps instead of copying the arrays
    def __reduce__(self):
        return (_reopen, (str(self.path), self.index["tokenizer_hash"], self.allow_skip_corrupt))

    @property
    def name(self) -> str:
        return self.index["name"]

    @property
    def num_samples(self) -> int:
        return int(self.index["num_samples"])

    @property
    def num_shards(self) -> int:
        return len(self.shard_table)

    @property
    def skipped_shards(self) -> list[str]:
        return [str(self.shard_file(i)) for i in sorted(self.bad_shards)]

    @property
    def shards(self) -> list[dict]:
        """The shard table as dicts (inspection and tests; O(shards) Python objects)."""
        return [dict(file=shard_name(i) if self.version >= 2 else self.index["shards"][i]["file"],
                     **{c: int(v) for c, v in zip(SHARD_COLUMNS, row)}) for i, row in enumerate(self.shard_table)]

    def shard_file(self, i: int) -> Path:
        return self.path / (shard_name(i) if self.version >= 2 else self.index["shards"][i]["file"])

    def shard_of(self, sid: int) -> int:
        return int(np.searchsorted(self.shard_first, sid, side="right") - 1)

    def shard_end(self, i: int) -> int:
        return int(self.shard_table[i, 0] + self.shard_table[i, 1])

    def tokens_between(self, lo: int, hi: int) -> int:
        """Tokens of sample ids ``[lo, hi)``: whole shards from the shard table, the partial ones at the
        ends from ``lengths`` (at most two shards' worth of the map is read)."""
        if hi <= lo:
            return 0
        s0, s1 = self.shard_of(lo), self.shard_of(hi - 1)
        if s0 == s1:
            return int(self.lengths[lo:hi].sum(dtype=np.int64))
        head = int(self.lengths[lo:self.shard_end(s0)].sum(dtype=np.int64))
        tail = int(self.lengths[int(self.shard_table[s1, 0]):hi].sum(dtype=np.int64))
        return head + int(self._token_cum[s1] - self._token_cum[s0 + 1]) + tail

    @classmethod
    def load(cls, path: str | os.PathLike, *, tokenizer_hash: str | None = None,
             allow_skip_corrupt: bool = False, stats: dict | None = None) -> "Dataset":
        """Open a dataset dir: index readable and of a known format version, tokenizer matches, every
        shard present (one directory listing). A missing shard raises :class:`CorruptShardError` naming it,
        or with ``allow_skip_corrupt`` is recorded as bad (logged, counted in ``stats['skipped_shards']``).
        Opened datasets are shared within a process (train and valid loaders use the same maps)."""
        path = Path(path)
        ipath = path / INDEX_FILE
        if not path.is_dir():
            raise IndexError_(f"dataset directory does not exist: {path}")
        if not ipath.is_file():
            raise IndexError_(f"dataset has no index (run `fbt data prepare`): {ipath}")
        try:
            raw = ipath.read_bytes()
            index = json.loads(raw)
        except Exception as exn:
            raise IndexError_(f"unreadable dataset index {ipath}: {exn}") from exn
        version = index_version(index, ipath)
        if tokenizer_hash is not None and index["tokenizer_hash"] != tokenizer_hash:
            raise TokenizerMismatchError(
                f"{ipath} was built with tokenizer {index['tokenizer_hash']} "
                f"({index.get('tokenizer_file')}), but the configured tokenizer is {tokenizer_hash}")
        key = (str(path.resolve()), hashlib.sha1(raw).hexdigest(), allow_skip_corrupt)
        ds = _OPEN.get(key)
        if ds is None:
            ds = cls._open(path, index, version, allow_skip_corrupt)
            _OPEN[key] = ds
        if stats is not None:
            for i in ds.bad_shards:
                stats["skipped_shards"] = stats.get("skipped_shards", 0) + 1
                stats["skipped_shard_samples"] = stats.get("skipped_shard_samples", 0) + int(ds.shard_table[i, 1])
        return ds

    @classmethod
    def _open(cls, path: Path, index: dict, version: int, allow_skip: bool) -> "Dataset":
        ipath = path / INDEX_FILE
        try:
            if version == 1:
                log.warning("%s: index format version 1 loads samples.npz into memory in every process; "
                            "run `fbt data prepare` again to get the memory-mapped version %d", ipath, FORMAT_VERSION)
                arr = np.load(path / LEGACY_SAMPLES_FILE)
                lengths, offsets, crc = arr["lengths"], arr["offsets"], arr["crc32"]
                table = np.array([[s[c] for c in SHARD_COLUMNS] for s in index["shards"]], np.int64).reshape(-1, 4)
                names = [s["file"] for s in index["shards"]]
            else:
                lengths, offsets, crc = (np.load(path / ARRAY_FILES[k], mmap_mode="r") for k in ("lengths", "offsets", "crc32"))
                for arr in (lengths, offsets, crc):  # shuffled reads: no readahead of neighbouring pages
                    mm = getattr(arr, "_mmap", None)
                    if mm is not None and hasattr(mmap, "MADV_RANDOM"):
                        mm.madvise(mmap.MADV_RANDOM)
                table = np.load(path / SHARDS_FILE).astype(np.int64, copy=False)
                names = [shard_name(i) for i in range(len(table))]
        except Exception as exn:
            raise IndexError_(f"unreadable dataset index in {path}: {exn}") from exn
        n = int(index["num_samples"])
        for what, a in (("lengths", lengths), ("offsets", offsets), ("crc32", crc)):
            if len(a) != n:
                raise IndexError_(f"{path}: {what} holds {len(a)} samples, {ipath} says {n}")
        if table.ndim != 2 or table.shape[1] != 4 or len(table) != int(index.get("num_shards", len(table))) \
                or int(table[:, 1].sum()) != n:
            raise IndexError_(f"{path / SHARDS_FILE}: shard table {table.shape} does not match {ipath}")
        present = set(os.listdir(path))  # one listing, no per-shard stat
        bad: dict[int, str] = {}
        for i, name in enumerate(names):
            if name in present:
                continue
            msg = f"corrupt shard {path / name}: missing"
            if not allow_skip:
                raise CorruptShardError(msg)
            log.warning("%s; its %d documents become loss-masked spans (allow_skip_corrupt)", msg, int(table[i, 1]))
            bad[i] = "missing"
        if len(bad) == len(names):
            raise CorruptShardError(f"dataset {path} has no usable shard")
        return cls(path, index, version, table, lengths, offsets, crc, bad, allow_skip)


def _reopen(path: str, thash: str, allow_skip: bool) -> Dataset:
    return Dataset.load(path, tokenizer_hash=thash, allow_skip_corrupt=allow_skip)


def _npy_payload(raw: bytes) -> int:
    """Offset of the array data in an ``.npy`` byte string (format 1.x/2.x/3.x header); -1 if not npy."""
    if raw[:6] != b"\x93NUMPY" or len(raw) < 12:
        return -1
    if raw[6] == 1:
        return 10 + int.from_bytes(raw[8:10], "little")
    return 12 + int.from_bytes(raw[8:12], "little")


class DatasetReader:
    """Reads documents by sample id: one ``pread`` of the document's byte range in its shard (files kept
    open in a small LRU), tar headers parsed with :mod:`tarfile`, content checked against the index's
    length and crc32. Not shared between processes (open one after a worker forks)."""

    MAX_OPEN = 16

    def __init__(self, ds: Dataset, *, allow_skip_corrupt: bool = False, stats: dict | None = None):
        self.ds = ds
        self.allow_skip = allow_skip_corrupt
        self.stats = stats if stats is not None else {}
        self.dtype = np.dtype(ds.index["token_dtype"])
        self._fds: OrderedDict[int, int] = OrderedDict()
        self.bad_shards: dict[int, str] = dict(ds.bad_shards)
        self.new_bad_shards: list[int] = []  # found bad by this reader since the caller last drained it
        self.last_skip = None  # "shard" or "sample": why the last get() returned None
        self.last_mask = None  # the last get()'s per-token loss mask (uint8; chat data), None if it has none

    def close(self):
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self):  # pragma: no cover - interpreter shutdown order
        try:
            self.close()
        except Exception:
            pass

    def _fd(self, shard: int) -> int | None:
        fd = self._fds.get(shard)
        if fd is not None:
            self._fds.move_to_end(shard)
            return fd
        if shard in self.bad_shards:
            return None
        f = self.ds.shard_file(shard)
        problem = None
        try:
            fd = os.open(f, os.O_RDONLY)
        except FileNotFoundError:
            problem = "missing"
        except OSError as exn:
            problem = f"unreadable ({exn})"
        else:
            size, want = os.fstat(fd).st_size, int(self.ds.shard_table[shard, 3])
            if size != want:
                os.close(fd)
                problem = f"size {size} bytes, index records {want} (truncated or rewritten)"
        if problem is not None:
            msg = f"corrupt shard {f}: {problem}"
            if not self.allow_skip:
                raise CorruptShardError(msg)
            log.warning("%s; its documents become loss-masked spans (allow_skip_corrupt)", msg)
            self.bad_shards[shard] = problem
            self.new_bad_shards.append(shard)
            return None
        self._fds[shard] = fd
        if len(self._fds) > self.MAX_OPEN:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def _corrupt(self, sid: int, shard: int, why: str) -> None:
        msg = f"corrupt shard {self.ds.shard_file(shard)}: sample {sid} ({sample_key(sid)}): {why}"
        if not self.allow_skip:
            raise CorruptShardError(msg)
        log.warning("%s; replaced by a loss-masked span (allow_skip_corrupt)", msg)
        self.stats["skipped_corrupt_samples"] = self.stats.get("skipped_corrupt_samples", 0) + 1
        self.last_skip = "sample"
        return None

    def get(self, sid: int) -> np.ndarray | None:
        """Tokens of sample ``sid``; ``None`` if it (or its shard) is corrupt and skipping is allowed."""
        ds = self.ds
        shard = ds.shard_of(sid)
        fd = self._fd(shard)
        if fd is None:
            self.last_skip = "shard"
            return None
        start = int(ds.offsets[sid])
        end = int(ds.offsets[sid + 1]) if sid + 1 < ds.shard_end(shard) else int(ds.shard_table[shard, 3])
        try:
            buf = os.pread(fd, end - start, start)
        except OSError as exn:
            return self._corrupt(sid, shard, f"read failed: {exn}")
        key = sample_key(sid)
        raw, raw_mask, o = None, None, 0
        self.last_mask = None
        try:
            while o + 512 <= len(buf) and buf[o:o + 512].count(0) != 512:
                ti = tarfile.TarInfo.frombuf(buf[o:o + 512], "utf-8", "surrogateescape")
                if ti.type in (tarfile.XHDTYPE, tarfile.XGLTYPE):  # a pax header (format 1 shards): skip it
                    o += 512 + -(-ti.size // 512) * 512
                    continue
                k, _, ext = ti.name.partition(".")
                if k != key:
                    return self._corrupt(sid, shard, f"expected key {key}, found {k}")
                data_at = o + 512
                if data_at + ti.size > len(buf):
                    return self._corrupt(sid, shard, f"member {ti.name} ends past the sample (truncated)")
                if ext == "tokens.npy":
                    raw = buf[data_at:data_at + ti.size]
                elif ext == "mask.npy":
                    raw_mask = buf[data_at:data_at + ti.size]
                o = data_at + -(-ti.size // 512) * 512
        except tarfile.TarError as exn:
            return self._corrupt(sid, shard, f"{type(exn).__name__}: {exn}")
        if raw is None:
            return self._corrupt(sid, shard, "no tokens.npy member")
        at = _npy_payload(raw)
        if at < 0 or (len(raw) - at) % self.dtype.itemsize:
            return self._corrupt(sid, shard, "tokens.npy is not a valid array")
        tokens = np.frombuffer(raw, self.dtype, offset=at)
        if len(tokens) != ds.lengths[sid] or zlib.crc32(tokens) != int(ds.crc32[sid]):
            return self._corrupt(sid, shard, "token content does not match the index (length or crc32)")
        if raw_mask is not None:
            at = _npy_payload(raw_mask)
            mask = np.frombuffer(raw_mask, np.uint8, offset=at) if at >= 0 else None
            if mask is None or len(mask) != len(tokens):
                return self._corrupt(sid, shard, "mask.npy is not a loss mask of the document's length")
            self.last_mask = mask
        return tokens


def verify_dataset(path: str | os.PathLike) -> dict:
    """Read every sample of a dataset and check it against the index; raises on the first bad one."""
    ds = Dataset.load(path)
    reader = DatasetReader(ds)
    tok = 0
    for sid in range(ds.num_samples):
        tok += len(reader.get(sid))
    reader.close()
    return {"samples": ds.num_samples, "tokens": tok,
            "sha": hashlib.sha256(json.dumps(ds.index, sort_keys=True).encode()).hexdigest()[:16]}
