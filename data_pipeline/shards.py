"""WebDataset shards of tokenized documents, their index, and random access into them.

A prepared dataset is a directory::

    index.json          name, tokenizer hash, eos id, dtype, per-shard samples/tokens/bytes
    samples.npz         per sample: lengths (tokens), offsets (byte offset of the sample's first tar
                        member in its shard), crc32 (of the token bytes)
    shard-000000.tar    WebDataset shards; sample key = global sample id (10 digits), members
    shard-000001.tar    ``<key>.tokens.npy`` (the token array) and ``<key>.json`` (source, doc_id, num_tokens)

The index maps a position to (shard, offset) without scanning: ``shard = searchsorted(first_sample, id)``
and the byte offset lets a reader seek straight to the sample and stream from there with WebDataset's
tar iterator (``webdataset.tariterators``), so a data-parallel rank reads only the byte ranges its
sequences use.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import multiprocessing as mp
import os
import shutil
import tarfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import webdataset as wds
from webdataset.tariterators import group_by_keys, tar_file_iterator

from .errors import CorruptShardError, IndexError_, SourceError, TokenizerMismatchError
from .sources import iter_documents
from .tokenizer import load_tokenizer, tokenizer_hash

log = logging.getLogger(__name__)

INDEX_FORMAT = "fbt-data-v1"
INDEX_FILE = "index.json"
SAMPLES_FILE = "samples.npz"


# --------------------------------------------------------------------------------------------- write
_SP = None


def _init_worker(model_path: str) -> None:
    global _SP
    _SP = load_tokenizer(model_path)


def _encode_chunk(chunk: list[tuple[str, str]]) -> list[tuple[str, list[int]]]:
    ids = _SP.encode([t for _, t in chunk])
    return [(d, i) for (d, _), i in zip(chunk, ids)]


def _chunks(docs, n):
    buf = []
    for d in docs:
        buf.append(d)
        if len(buf) >= n:
            yield buf
            buf = []
    if buf:
        yield buf


def _member_offsets(path: Path) -> dict[str, int]:
    """Byte offset of the first member of each sample key (read back from the written tar)."""
    out: dict[str, int] = {}
    with tarfile.open(path, "r:") as tf:
        for m in tf.getmembers():
            key = m.name.split(".", 1)[0]
            out.setdefault(key, m.offset)
    return out


def sample_key(sid: int) -> str:
    return f"{sid:010d}"


def _encode_tokens(ids, dtype) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asarray(ids, dtype=dtype), allow_pickle=False)
    return buf.getvalue()


def prepare_dataset(
    paths: list[str],
    out_dir: str | os.PathLike,
    tokenizer: str | os.PathLike,
    *,
    name: str | None = None,
    shard_bytes: int = 16 << 20,
    num_workers: int = 1,
    text_field: str = "text",
    id_field: str | None = "id",
    progress: bool = True,
    documents=None,
    extra_meta: dict | None = None,
) -> dict:
    """Tokenize the documents behind ``paths`` (or the iterable ``documents`` of ``(doc_id, text)``)
    in ``num_workers`` processes and write shards of about ``shard_bytes`` bytes into ``out_dir``.

    Writes into ``out_dir.tmp`` and renames at the end, so a half-written dataset never looks done.
    Returns the index. Raises :class:`SourceError` for a missing path or a source with no documents.
    """
    out_dir = Path(out_dir)
    name = name or out_dir.name
    sp = load_tokenizer(tokenizer)
    thash = tokenizer_hash(tokenizer)
    vocab = sp.vocab_size()
    dtype = np.uint16 if vocab <= 65535 else np.int32
    counts: dict = {}
    if documents is None:
        if not paths:
            raise SourceError(f"source {name!r}: no paths given")
        documents = iter_documents(paths, text_field=text_field, id_field=id_field, counts=counts)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)

    shards: list[dict] = []
    lengths: list[int] = []
    offsets: list[int] = []
    crcs: list[int] = []
    state = {"writer": None, "fh": None, "bytes": 0, "n": 0, "tok": 0, "first": 0}

    def close_shard():
        if state["writer"] is None:
            return
        state["writer"].close()
        state["fh"].close()
        path = tmp / shards[-1]["file"]
        offs = _member_offsets(path)
        first = state["first"]
        for sid in range(first, first + state["n"]):
            offsets.append(offs[sample_key(sid)])
        shards[-1].update(num_samples=state["n"], num_tokens=state["tok"], bytes=path.stat().st_size)
        state.update(writer=None, fh=None)

    def open_shard():
        fname = f"shard-{len(shards):06d}.tar"
        fh = open(tmp / fname, "wb")
        state.update(fh=fh, writer=wds.TarWriter(fh, mtime=0.0), bytes=0, n=0, tok=0, first=len(lengths))
        shards.append({"file": fname, "first_sample": len(lengths)})

    t0 = time.time()
    pbar = None
    if progress:
        from tqdm import tqdm

        pbar = tqdm(desc=f"prepare {name}", unit="doc", mininterval=0.5)
    pool = None
    if num_workers > 1:
        pool = mp.get_context("fork").Pool(num_workers, initializer=_init_worker, initargs=(str(tokenizer),))
        results = pool.imap(_encode_chunk, _chunks(documents, 64), chunksize=2)
    else:
        _init_worker(str(tokenizer))
        results = map(_encode_chunk, _chunks(documents, 64))
    try:
        for chunk in results:
            for doc_id, ids in chunk:
                if not ids:  # text that encodes to nothing: count it, never silently
                    counts["empty"] = counts.get("empty", 0) + 1
                    continue
                if state["writer"] is None:
                    open_shard()
                sid = len(lengths)
                tok_bytes = _encode_tokens(ids, dtype)
                meta = json.dumps({"source": name, "doc_id": doc_id, "num_tokens": len(ids)}).encode()
                state["writer"].write({"__key__": sample_key(sid), "tokens.npy": tok_bytes, "json": meta})
                lengths.append(len(ids))
                crcs.append(zlib.crc32(np.asarray(ids, dtype=dtype).tobytes()))
                state["bytes"] += len(tok_bytes) + len(meta) + 1536  # + tar headers and padding
                state["n"] += 1
                state["tok"] += len(ids)
                if state["bytes"] >= shard_bytes:
                    close_shard()
            if pbar is not None:
                pbar.update(len(chunk))
    finally:
        if pool is not None:
            pool.terminate()
        if pbar is not None:
            pbar.close()
    close_shard()
    if not lengths:
        shutil.rmtree(tmp)
        where = ", ".join(map(str, paths)) if paths else name
        raise SourceError(f"source {name!r} is empty: no non-empty documents in {where} "
                          f"({counts.get('empty', 0)} empty skipped)")
    np.savez(tmp / SAMPLES_FILE, lengths=np.asarray(lengths, np.int32),
             offsets=np.asarray(offsets, np.int64), crc32=np.asarray(crcs, np.uint32))
    index = {
        "format": INDEX_FORMAT,
        "name": name,
        "tokenizer_hash": thash,
        "tokenizer_file": os.path.basename(str(tokenizer)),
        "vocab_size": vocab,
        "eos_id": sp.eos_id(),
        "token_dtype": np.dtype(dtype).name,
        "num_samples": len(lengths),
        "num_tokens": int(sum(lengths)),
        "skipped_empty_documents": counts.get("empty", 0),
        "num_files": counts.get("files"),
        "sources": [str(p) for p in paths] if paths else None,
        "shards": shards,
        "seconds": round(time.time() - t0, 3),
    }
    if extra_meta:
        index["meta"] = extra_meta
    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=1))
    if index["skipped_empty_documents"]:
        log.warning("source %s: skipped %d empty documents", name, index["skipped_empty_documents"])
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return index


# ---------------------------------------------------------------------------------------------- read
@dataclass
class Dataset:
    """A prepared dataset's metadata (no shard is opened). ``shards`` lists only usable shards."""

    path: Path
    index: dict
    lengths: np.ndarray
    offsets: np.ndarray
    crc32: np.ndarray
    shards: list[dict]
    skipped_shards: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.index["name"]

    @property
    def num_samples(self) -> int:
        return int(sum(s["num_samples"] for s in self.shards))

    @classmethod
    def load(cls, path: str | os.PathLike, *, tokenizer_hash: str | None = None,
             allow_skip_corrupt: bool = False, stats: dict | None = None) -> "Dataset":
        """Load and check a dataset dir: index readable, tokenizer matches, each shard present with the
        recorded size. A bad shard raises :class:`CorruptShardError` naming it, or with
        ``allow_skip_corrupt`` is excluded (logged, counted in ``stats['skipped_shards']``)."""
        path = Path(path)
        ipath = path / INDEX_FILE
        if not path.is_dir():
            raise IndexError_(f"dataset directory does not exist: {path}")
        if not ipath.is_file():
            raise IndexError_(f"dataset has no index (run `fbt data prepare`): {ipath}")
        try:
            index = json.loads(ipath.read_text())
            arr = np.load(path / SAMPLES_FILE)
            lengths, offsets, crc = arr["lengths"], arr["offsets"], arr["crc32"]
        except Exception as exn:
            raise IndexError_(f"unreadable dataset index in {path}: {exn}") from exn
        if index.get("format") != INDEX_FORMAT:
            raise IndexError_(f"{ipath}: unknown format {index.get('format')!r} (expected {INDEX_FORMAT})")
        if tokenizer_hash is not None and index["tokenizer_hash"] != tokenizer_hash:
            raise TokenizerMismatchError(
                f"{ipath} was built with tokenizer {index['tokenizer_hash']} "
                f"({index.get('tokenizer_file')}), but the configured tokenizer is {tokenizer_hash}")
        if len(lengths) != index["num_samples"]:
            raise IndexError_(f"{path / SAMPLES_FILE}: {len(lengths)} samples, index says {index['num_samples']}")
        good, skipped = [], []
        for sh in index["shards"]:
            f = path / sh["file"]
            problem = None
            if not f.is_file():
                problem = "missing"
            elif f.stat().st_size != sh["bytes"]:
                problem = f"size {f.stat().st_size} bytes, index records {sh['bytes']} (truncated or rewritten)"
            if problem is None:
                good.append(sh)
                continue
            msg = f"corrupt shard {f}: {problem}"
            if not allow_skip_corrupt:
                raise CorruptShardError(msg)
            log.warning("%s; skipping its %d samples (allow_skip_corrupt)", msg, sh["num_samples"])
            skipped.append(str(f))
            if stats is not None:
                stats["skipped_shards"] = stats.get("skipped_shards", 0) + 1
                stats["skipped_shard_samples"] = stats.get("skipped_shard_samples", 0) + sh["num_samples"]
        if not good:
            raise CorruptShardError(f"dataset {path} has no usable shard")
        return cls(path, index, lengths, offsets, crc, good, skipped)

    def epoch_layout(self):
        """(first_sample ids, sizes) of the usable shards, in stored order."""
        firsts = np.array([s["first_sample"] for s in self.shards], np.int64)
        sizes = np.array([s["num_samples"] for s in self.shards], np.int64)
        return firsts, sizes


class DatasetReader:
    """Reads samples by id from one dataset, seeking to each run's first sample and streaming onwards
    with WebDataset's tar iterator. Not shared between processes (open it after a worker forks)."""

    SKIP_AHEAD = 64  # stream past at most this many samples instead of seeking

    def __init__(self, ds: Dataset, *, allow_skip_corrupt: bool = False, stats: dict | None = None):
        self.ds = ds
        self.allow_skip = allow_skip_corrupt
        self.stats = stats if stats is not None else {}
        self.dtype = np.dtype(ds.index["token_dtype"])
        all_first = np.array([s["first_sample"] for s in ds.index["shards"]], np.int64)
        self._all_first = all_first
        self._fh = None
        self._it = None
        self._shard = -1
        self._next = -1

    def close(self):
        if self._fh is not None:
            self._fh.close()
        self._fh = self._it = None
        self._shard = self._next = -1

    def _open(self, shard: int, sid: int):
        self.close()
        f = self.ds.path / self.ds.index["shards"][shard]["file"]
        self._file = f
        fh = open(f, "rb")
        fh.seek(int(self.ds.offsets[sid]))
        url = str(f)

        def files():
            for x in tar_file_iterator(fh):
                x["__url__"] = url
                yield x

        self._fh, self._it, self._shard, self._next = fh, group_by_keys(files()), shard, sid

    def _corrupt(self, sid: int, why: str) -> None:
        msg = f"corrupt shard {self._file}: sample {sid} ({sample_key(sid)}): {why}"
        self.close()
        if not self.allow_skip:
            raise CorruptShardError(msg)
        log.warning("%s; replaced by a loss-masked span (allow_skip_corrupt)", msg)
        self.stats["skipped_corrupt_samples"] = self.stats.get("skipped_corrupt_samples", 0) + 1

    def get(self, sid: int) -> np.ndarray | None:
        """Tokens of sample ``sid``; ``None`` if it is corrupt and skipping is allowed."""
        shard = int(np.searchsorted(self._all_first, sid, side="right") - 1)
        if not (shard == self._shard and self._next <= sid <= self._next + self.SKIP_AHEAD):
            self._open(shard, sid)
        key = sample_key(sid)
        try:
            while True:
                sample = next(self._it)
                self._next += 1
                if sample["__key__"] == key:
                    break
                if sample["__key__"] > key:
                    return self._corrupt(sid, f"expected key {key}, found {sample['__key__']}")
            raw = sample.get("tokens.npy")
            if raw is None:
                return self._corrupt(sid, "no tokens.npy member")
            tokens = np.load(io.BytesIO(raw), allow_pickle=False)
        except StopIteration:
            return self._corrupt(sid, "shard ends before this sample (truncated)")
        except (tarfile.TarError, ValueError, OSError, EOFError) as exn:
            return self._corrupt(sid, f"{type(exn).__name__}: {exn}")
        if len(tokens) != self.ds.lengths[sid] or zlib.crc32(tokens.tobytes()) != int(self.ds.crc32[sid]):
            return self._corrupt(sid, "token content does not match the index (length or crc32)")
        return tokens


def verify_dataset(path: str | os.PathLike) -> dict:
    """Read every sample of a dataset and check it against the index; raises on the first bad one."""
    ds = Dataset.load(path)
    reader = DatasetReader(ds)
    n = tok = 0
    for sh in ds.shards:
        for sid in range(sh["first_sample"], sh["first_sample"] + sh["num_samples"]):
            tok += len(reader.get(sid))
            n += 1
    reader.close()
    return {"samples": n, "tokens": tok, "sha": hashlib.sha256(json.dumps(ds.index, sort_keys=True).encode()).hexdigest()[:16]}
