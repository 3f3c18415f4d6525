"""``fbt data prepare``: tokenize documents into WebDataset shards and the memory-mapped index.

How the work is split, and why:

* The parent process reads the inputs (JSONL decoding costs little next to tokenizing) and cuts the
  document stream into **shard tasks** by an estimate of the shard's size from the text length, so the
  cut depends only on the input (the output is byte-identical for any worker count).
* Each task (shard number, first sample id, its documents) goes to a worker process that tokenizes it
  (sentencepiece, one thread), writes ``shard-NNNNNN.tar`` (WebDataset ``TarWriter``, recording each
  sample's byte offset while writing: no re-read) and a small ``.meta.npz`` with the shard's per-document
  lengths, offsets and crc32 as numpy arrays. At most ``2 * workers`` tasks are in flight, so memory is
  bounded by a few shards of text whatever the corpus size.
* Everything is written into ``<out>.tmp``; a finished shard is renamed into place last. A crashed or
  interrupted run is resumed by running the same command again: the settings (inputs with size and
  mtime, tokenizer, shard size) are recorded in ``prepare.json``; when they match, finished shards are
  kept and their documents are not tokenized again. At the end the per-shard arrays are concatenated into
  ``lengths.npy``/``offsets.npy``/``crc32.npy`` through ``numpy`` memmaps and the directory renamed into
  place, so a half-written dataset never looks done.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import hashlib
import json
import logging
import multiprocessing as mp
import os
import shutil
import socket
import sys
import time
import zlib
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import webdataset as wds

from .errors import EmptySourceError, OutOfSpaceError, SourceError, UserError
from .output_dir import OutputDirError, earlier_output, replace_dir
from .shards import (ARRAY_FILES, FORMAT, FORMAT_VERSION, INDEX_FILE, LEGACY_SAMPLES_FILE, SHARDS_FILE, sample_key,
                     shard_name)
from .sources import expand_paths, fingerprint_files, iter_documents
from .tokenizer import load_tokenizer, resolve_bos, tokenizer_hash

log = logging.getLogger(__name__)

SETTINGS_FILE = "prepare.json"
# what `fbt data prepare` writes into a dataset directory (and its <out>.tmp): only such a directory is replaced
DATASET_ENTRIES = (INDEX_FILE, SETTINGS_FILE, SHARDS_FILE, LEGACY_SAMPLES_FILE, *ARRAY_FILES.values(), "shard-*.tar",
                   "shard-*.tar.part", "shard-*.meta.npz", "shard-*.meta.part.npz")
WRITER = "fbt data prepare"
TAR_OVERHEAD = 1536  # tar headers and padding of a sample's two members (estimate)


def _npy_bytes(arr: np.ndarray) -> bytes:
    """A 1-D array as ``.npy`` (format 1.0) bytes, its header written by hand: ``np.save``'s generic writer
    is the slow part for these small per-shard arrays (docs/results/benchmarks.md)."""
    header = "{'descr': '%s', 'fortran_order': False, 'shape': (%d,), }" % (arr.dtype.str, len(arr))
    pad = 64 - (10 + len(header) + 1) % 64
    header = (header + " " * (pad % 64) + "\n").encode("latin1")
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + arr.tobytes()


# ------------------------------------------------------------------------------------------ worker
_W: dict = {}


def _init_worker(model_path: str, out: str, name: str, dtype: str, bos: int | None = None) -> None:
    _W.update(sp=load_tokenizer(model_path), out=Path(out), name=name, dtype=np.dtype(dtype), bos=bos)


def _write_shard(task: tuple[int, int, list[tuple[str, str]]]) -> dict:
    """Tokenize one shard's documents and write the shard and its per-document arrays (atomically)."""
    shard, first, docs = task
    sp, out, name, dtype = _W["sp"], _W["out"], _W["name"], _W["dtype"]
    masks = [d[2] for d in docs] if len(docs[0]) == 3 else None  # chat: (doc_id, ids, loss mask), see chat.py
    ids = [d[1] for d in docs] if masks is not None else \
        sp.encode([t for _, t in docs], num_threads=1)  # one thread: the processes are the parallelism
    if _W.get("bos") is not None and masks is None:  # --bos: each document starts with the BOS
        ids = [[_W["bos"], *x] for x in ids]
    n = len(docs)
    lengths, offsets, crcs = np.empty(n, np.int32), np.empty(n, np.int64), np.empty(n, np.uint32)
    tar, part = out / shard_name(shard), out / (shard_name(shard) + ".part")
    empty = 0
    with open(part, "wb") as fh:
        writer = wds.TarWriter(fh, mtime=0)  # an int: a float mtime costs a pax header per member
        for j, (doc, toks) in enumerate(zip(docs, ids)):
            doc_id = doc[0]
            arr = np.asarray(toks, dtype)
            empty += len(arr) == 0  # text that encodes to nothing: kept (an EOS in the stream), counted
            offsets[j] = writer.tarstream.offset  # where this sample's first member's header starts
            meta = json.dumps({"source": name, "doc_id": doc_id, "num_tokens": len(arr)}).encode()
            sample = {"__key__": sample_key(first + j), "tokens.npy": _npy_bytes(arr), "json": meta}
            if masks is not None:  # per-token loss mask (uint8), read by shards.DatasetReader
                sample["mask.npy"] = _npy_bytes(np.asarray(masks[j], np.uint8))
            writer.write(sample)
            lengths[j] = len(arr)
            crcs[j] = zlib.crc32(arr)
        writer.close()
    info = {"shard": shard, "first_sample": first, "num_samples": n, "num_tokens": int(lengths.sum(dtype=np.int64)),
            "bytes": part.stat().st_size, "empty_encoded": int(empty)}
    meta_part = out / f"{shard_name(shard)}.meta.part.npz"
    np.savez(meta_part, lengths=lengths, offsets=offsets, crc32=crcs, info=np.array(json.dumps(info)))
    os.replace(meta_part, _meta_path(out, shard))
    os.replace(part, tar)  # last: a shard is finished when its tar exists
    return info


def _meta_path(out: Path, shard: int) -> Path:
    return out / f"{shard_name(shard)}.meta.npz"


def _finished(out: Path, shard: int, n_docs: int, first: int) -> dict | None:
    """The info of a shard a previous run finished (tar and arrays present and consistent), else None."""
    tar, meta = out / shard_name(shard), _meta_path(out, shard)
    if not (tar.is_file() and meta.is_file()):
        return None
    try:
        with np.load(meta) as z:
            info = json.loads(str(z["info"]))
    except Exception:
        return None
    ok = (info.get("num_samples") == n_docs and info.get("first_sample") == first
          and tar.stat().st_size == info.get("bytes"))
    return info if ok else None


# ------------------------------------------------------------------------------------------ parent
def _shard_tasks(documents, shard_bytes: int, counts: dict):
    """Cut ``(doc_id, text)`` into shard tasks of about ``shard_bytes`` written bytes (estimated from the
    text: ~2 bytes per token, ~4 characters per token, plus tar/json overhead per document)."""
    buf, est, shard, first = [], 0, 0, 0
    for doc in documents:
        doc_id, text = doc[0], doc[1]
        if len(doc) == 3:  # pre-tokenized (doc_id, ids, loss mask): 3 bytes per token written
            buf.append(doc)
            est += 3 * len(text) + 2 * TAR_OVERHEAD + len(doc_id) + 48
        elif not text.strip():
            counts["empty"] = counts.get("empty", 0) + 1
            continue
        else:
            buf.append((doc_id, text))
            est += len(text) // 2 + TAR_OVERHEAD + len(doc_id) + 48
        if est >= shard_bytes:
            yield shard, first, buf
            shard, first, buf, est = shard + 1, first + len(buf), [], 0
    if buf:
        yield shard, first, buf


def _input_fingerprint(paths: list[str]) -> list:
    out = []
    for source in expand_paths(paths):
        for f in fingerprint_files(source):
            st = f.stat()
            out.append([str(f), st.st_size, st.st_mtime_ns])
    return out


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
    skip_bad_rows: bool = False,
    bos: str = "no",
    overwrite: bool = False,
) -> dict:
    """Tokenize the documents behind ``paths`` (or the iterable ``documents`` of ``(doc_id, text)``) in
    ``num_workers`` processes into shards of about ``shard_bytes`` bytes in ``out_dir``; returns the index.
    ``documents`` may also yield pre-tokenized ``(doc_id, ids, loss_mask)`` (chat data, ``chat.py``).

    Resumable: after a crash, the same call keeps the shards the crashed run finished (see the module
    docstring). Raises :class:`SourceError` for a missing path, a source with no documents, or a bad
    row (``sources.py``; ``skip_bad_rows``: skipped and counted in the index instead). ``bos``: a BOS
    before each text document, ``no``/``yes``/``auto`` (``tokenizer.resolve_bos``; recorded in the index as
    ``bos_added_id``, null for none).

    ``out_dir`` (:mod:`output_dir`'s rule): absent or empty, it is written; holding a dataset of the same
    inputs, tokenizer and settings, that dataset's index is returned and nothing is written; holding
    another dataset, it is replaced only with ``overwrite``; holding anything else, :class:`OutputDirError`.
    """
    out_dir = Path(out_dir)
    name = name or out_dir.name
    sp = load_tokenizer(tokenizer)
    thash = tokenizer_hash(tokenizer)
    vocab = sp.vocab_size()
    dtype = np.dtype(np.uint16 if vocab <= 65535 else np.int32)
    bos_id = resolve_bos(sp, bos, tokenizer)
    counts: dict = {}
    if documents is None:
        if not paths:
            raise SourceError(f"source {name!r}: no paths given")
        inputs = _input_fingerprint(paths)  # also checks every path before anything is written
        documents = iter_documents(paths, text_field=text_field, id_field=id_field, counts=counts,
                                   skip_bad_rows=skip_bad_rows)
    else:
        inputs = None
    settings = {"format_version": FORMAT_VERSION, "name": name, "tokenizer_hash": thash, "shard_bytes": shard_bytes,
                "text_field": text_field, "id_field": id_field, "inputs": inputs, "meta": extra_meta,
                "skip_bad_rows": skip_bad_rows, "bos_added_id": bos_id}
    # the dataset's identity, recorded in its index: taken now (a chat source's meta fills in while it is read)
    settings_hash = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    # documents from a caller that describes none of them (no inputs, no meta) cannot be told the same
    same = _earlier_dataset(out_dir, settings_hash if inputs is not None or extra_meta else None, overwrite)
    if same is not None:
        if progress:
            print(f"prepare {name}: {out_dir} already holds this dataset (the same inputs, tokenizer and settings; "
                  f"{same['num_samples']:,} documents): nothing written", file=sys.stderr)
        return same
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    # two runs writing the same <out>.tmp would corrupt it
    lock = exclusive_lock(out_dir.with_name(out_dir.name + ".lock"),
                          f"another `fbt data prepare` is writing {tmp}: wait for it or stop it")
    try:
        return _prepare(documents, out_dir, tmp, tokenizer, name=name, thash=thash, vocab=vocab, eos=sp.eos_id(), bos=bos_id,
                        dtype=dtype, counts=counts, settings=settings, shard_bytes=shard_bytes,
                        num_workers=num_workers, progress=progress, paths=paths, extra_meta=extra_meta,
                        settings_hash=settings_hash)
    except OSError as exn:
        if exn.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise OutOfSpaceError(_out_of_space(tmp, exn, inputs)) from None
    finally:
        Path(lock.name).unlink(missing_ok=True)
        lock.close()


PLAIN_TEXT = (".jsonl", ".json", ".txt", ".md")  # inputs whose size tells the text's size (not compressed)


def _out_of_space(tmp: Path, exn: OSError, inputs: list | None) -> str:
    """The sentence for a full disk: where, the space free against an estimate of what is still to be
    written (plain-text inputs only: about 2 bytes per 4 characters, as :func:`_shard_tasks` estimates), what
    was kept, and that a rerun resumes."""
    where = Path(exn.filename) if exn.filename else tmp
    kept = sorted(tmp.glob("shard-*.tar")) if tmp.is_dir() else []
    written = sum(f.stat().st_size for f in kept)
    try:
        free = f"{shutil.disk_usage(tmp if tmp.is_dir() else tmp.parent).free / 1e6:,.1f} MB free"
    except OSError:
        free = "free space unknown"
    need = ""
    if inputs and all(Path(f).suffix in PLAIN_TEXT for f, _, _ in inputs):
        more = max(0, sum(size for _, size, _ in inputs) // 2 - written)
        need = f" against about {more / 1e6:,.1f} MB still to write (estimated from the inputs' size)"
    shards = f"{len(kept)} finished shard" + ("" if len(kept) == 1 else "s")
    return (f"no space left on the device writing {where} ({free}{need}): {shards} kept in {tmp}; "
            f"free space and run the same command again to resume")


def _earlier_dataset(out_dir: Path, settings_hash: str | None, overwrite: bool) -> dict | None:
    """The index of the dataset at ``out_dir`` when it is the one these settings write (``settings_hash``;
    None: never the same); None when ``out_dir`` is free to write (absent, empty, or another dataset and
    ``overwrite``). Another dataset without ``overwrite``, or anything else there: :class:`OutputDirError`."""
    if not earlier_output(out_dir, markers=(INDEX_FILE,), patterns=DATASET_ENTRIES, writer=WRITER):
        return None
    try:
        index = json.loads((out_dir / INDEX_FILE).read_text())
    except (OSError, ValueError):
        index = None
    if isinstance(index, dict) and settings_hash is not None and index.get("settings_hash") == settings_hash:
        return index
    if overwrite:
        return None
    raise OutputDirError(f"--out {out_dir} holds {held_dataset(index, by_array=False)}: nothing was changed; "
                         f"pass --overwrite to replace it, or choose another directory")


def held_dataset(index, *, by_array: bool) -> str:
    """A refused ``--out``'s dataset in words, for a writer of ``fbt data prepare``'s kind or (``by_array``)
    of the job array's: a dataset the other kind wrote may hold the same inputs, which neither records
    in the other's terms, so it is named by its writer instead of called one of other inputs."""
    if not isinstance(index, dict):
        return f"a dataset with an unreadable {INDEX_FILE}"
    size = f"{index.get('num_samples', '?')} documents of {index.get('name', '?')!r}"
    made = index.get("prepare")
    from_array = isinstance(made, dict) and made.get("plan") is not None
    if from_array == by_array:
        return f"a dataset of other inputs or settings ({size})"
    writer = "fbt slurm submit-prepare's job array" if from_array else "fbt data prepare"
    return f"a dataset {writer} wrote ({size}; train on it as it is if it holds these inputs)"


_HELD_LOCKS: list = []  # this process's open locks: a forked worker closes its copies (:func:`_init_forked_worker`)


def _holder(text: str) -> tuple[str, str | None, int | None]:
    """(pid, host, process group) from a lock file's ``PID HOST PGID`` (an older one holds the pid only)."""
    parts = text.split()
    pid = parts[0] if parts else "?"
    host = parts[1] if len(parts) > 1 else None
    pgid = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else None
    return pid, host, pgid


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live group
        return True
    return True


def _dead_holder(text: str) -> bool:
    """Whether the lock's holder is known dead: on this host, and no process of its group is left."""
    _, host, pgid = _holder(text)
    return host == socket.gethostname() and pgid is not None and not _group_alive(pgid)


def _live_holder(text: str) -> bool:
    """Whether the lock file names another process of this host that is still running."""
    pid, host, _ = _holder(text)
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exclusive_lock(path: Path, busy: str):
    """An exclusive lock on ``path`` (created, with its directory), holding ``PID HOST PGID`` of this
    process; the open file is the lock (close it to release). Held by a live process:
    SourceError ``"{busy} (pid P on HOST; lock PATH)"``. Held by a process group that is gone (its
    processes killed, on this host): taken over with a warning. On a file system without locks (some
    shared ones) a holder still running on this host is refused the same way; else it warns and goes on
    unlocked, since refusing would stop every run there: the caller's other checks then stand alone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _HELD_LOCKS[:] = [f for f in _HELD_LOCKS if not f.closed]
    for attempt in (0, 1):
        fh = open(path, "a+")
        fh.seek(0)
        text = fh.read().strip()
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            if attempt == 0 and _dead_holder(text):  # a lock is an inode: a new file is a new lock
                log.warning("%s: taking over the lock of pid %s, whose process group is gone", path, _holder(text)[0])
                path.unlink(missing_ok=True)
                continue
            pid, host, _ = _holder(text)
            raise SourceError(f"{busy} (pid {pid}{f' on {host}' if host else ''}; lock {path})") from None
        except OSError as exn:
            if _live_holder(text):  # no lock to test: the file's holder (a finished run leaves its file behind)
                fh.close()
                pid, host, _ = _holder(text)
                raise SourceError(f"{busy} (pid {pid} on {host}; lock {path})") from None
            log.warning("%s: no lock on this file system (%s): two runs at once would not be stopped", path, exn)
        break
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()} {socket.gethostname()} {os.getpgid(0)}")
    fh.flush()
    _HELD_LOCKS.append(fh)
    return fh


def _die_with_parent(parent: int) -> None:
    """Linux: this process is killed when ``parent`` ends (``prctl(PR_SET_PDEATHSIG, SIGKILL)``), so a
    killed prepare leaves no worker behind blocked on its pipe; it exits now if ``parent`` is gone already."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def _init_forked_worker(parent: int, *init) -> None:
    """A pool worker's start: it dies with ``parent``, and closes its copies of the parent's locks (a
    lock is released only when every copy is closed)."""
    _die_with_parent(parent)
    for fh in _HELD_LOCKS:
        if not fh.closed:
            fh.close()
    _HELD_LOCKS.clear()
    _init_worker(*init)


def run_shard_tasks(tasks, init: tuple, num_workers: int, finished=None):
    """Yield ``(info, fresh)`` for each shard task ``(shard, first_sample, docs)`` in order: written by
    ``num_workers`` processes (in this process for 1), or ``finished(shard, n_docs, first)``'s info of a
    shard an earlier run wrote (``fresh`` False). At most ``2 * workers`` tasks are in flight; stopping
    early (an error, a closed generator) leaves the finished shards in place for a resume."""
    pool = None
    try:
        if num_workers > 1:
            # forked workers would otherwise copy the parent's heap page by page as their garbage
            # collector walks the inherited objects (torch is imported by webdataset): freeze them first
            gc.freeze()
            pool = ProcessPoolExecutor(num_workers, mp_context=mp.get_context("fork"),
                                       initializer=_init_forked_worker, initargs=(os.getpid(), *init))
            submit = pool.submit
        else:
            _init_worker(*init)

            class _Now:  # the in-process path with the pool's interface
                def __init__(self, fn, task):
                    self.value = fn(task)

                def result(self):
                    return self.value

            submit = _Now
        pending: deque = deque()
        for shard, first, docs in tasks:
            prev = finished(shard, len(docs), first) if finished is not None else None
            if prev is not None:
                yield prev, False
                continue
            pending.append(submit(_write_shard, (shard, first, docs)))
            while len(pending) >= 2 * max(1, num_workers):  # bounded memory: a few shards in flight
                yield pending.popleft().result(), True
        while pending:
            yield pending.popleft().result(), True
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)  # finished shards stay for a resume
            gc.unfreeze()


def _prepare(documents, out_dir: Path, tmp: Path, tokenizer, *, name, thash, vocab, eos, bos, dtype, counts, settings,
             shard_bytes, num_workers, progress, paths, extra_meta, settings_hash) -> dict:
    resumed = False
    # <out>.tmp is removed or resumed only when an earlier prepare left it (refused when it holds other files)
    if earlier_output(tmp, markers=(SETTINGS_FILE, INDEX_FILE), patterns=DATASET_ENTRIES, writer=WRITER,
                      option="the work directory"):
        try:
            resumed = json.loads((tmp / SETTINGS_FILE).read_text()) == settings
        except (OSError, json.JSONDecodeError):
            resumed = False
        if not resumed:
            log.info("%s: left by a run with other settings; starting over", tmp)
            shutil.rmtree(tmp)
        else:
            for p in tmp.glob("*.part*"):  # shards in flight when the previous run stopped
                p.unlink()
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / SETTINGS_FILE).write_text(json.dumps(settings))

    t0 = time.time()
    infos: list[dict] = []
    done_docs = done_tokens = kept = 0
    pbar = None
    if progress:
        from tqdm import tqdm

        pbar = tqdm(desc=f"prepare {name}", unit="doc", unit_scale=True, mininterval=0.5, file=sys.stderr)

    def finish(info: dict, fresh: bool) -> None:
        nonlocal done_docs, done_tokens
        infos.append(info)
        if fresh:
            done_docs += info["num_samples"]
            done_tokens += info["num_tokens"]
        if pbar is not None:
            pbar.update(info["num_samples"])
            pbar.set_postfix(tokens=f"{done_tokens / 1e6:.1f}M", shards=len(infos), refresh=False)

    init = (str(tokenizer), str(tmp), name, dtype.str, bos)
    tasks = _shard_tasks(documents, shard_bytes, counts)
    try:
        for info, fresh in run_shard_tasks(tasks, init, num_workers,
                                           (lambda s, n, f: _finished(tmp, s, n, f)) if resumed else None):
            kept += not fresh
            finish(info, fresh)
    except UserError:  # bad input (a missing column, a bad row): nothing to resume unless a shard is done
        if not any(tmp.glob("shard-*.tar")):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if pbar is not None:
            pbar.close()
    if not infos:
        shutil.rmtree(tmp)
        where = ", ".join(map(str, paths)) if paths else name
        raise EmptySourceError(f"source {name!r} is empty: no non-empty documents in {where} "
                          f"({counts.get('empty', 0)} empty skipped)")
    infos.sort(key=lambda i: i["shard"])
    index = _write_index(tmp, infos, name=name, thash=thash, tokenizer=tokenizer, vocab=vocab, eos=eos, bos=bos,
                         dtype=dtype, counts=counts, paths=paths, extra_meta=extra_meta)
    seconds = time.time() - t0
    index["settings_hash"] = settings_hash
    index["seconds"] = round(seconds, 3)
    index["prepare"] = {"workers": num_workers, "resumed_shards": kept,
                        "tokens_per_s": round(done_tokens / max(seconds, 1e-9))}
    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=1))
    (tmp / SETTINGS_FILE).unlink()
    if index["skipped_bad_rows"]:
        log.warning("source %s: skipped %d bad rows (first: %s)", name, index["skipped_bad_rows"], index["first_bad_row"])
    if index["skipped_empty_documents"]:
        log.warning("source %s: skipped %d empty documents", name, index["skipped_empty_documents"])
    replace_dir(tmp, out_dir, markers=(INDEX_FILE,), patterns=DATASET_ENTRIES, writer=WRITER)
    if progress:
        again = f" ({kept} finished shards kept from an interrupted run)" if kept else ""
        print(f"prepare {name}: {index['num_samples']:,} documents, {index['num_tokens']:,} tokens, "
              f"{len(infos)} shards in {seconds:.1f}s: {done_tokens / max(seconds, 1e-9):,.0f} tokens/s "
              f"with {num_workers} worker(s){again}", file=sys.stderr)
    return index


def drop_shard_meta(tmp: Path, infos: list[dict]) -> None:
    for info in infos:
        _meta_path(tmp, info["shard"]).unlink(missing_ok=True)


def _write_index(tmp: Path, infos: list[dict], *, name, thash, tokenizer, vocab, eos, dtype, counts, paths,
                 extra_meta, bos: int | None = None, drop_meta: bool = True) -> dict:
    """Concatenate the shards' arrays into the memory-mapped ``.npy`` files (streamed: bounded memory);
    ``drop_meta``: delete the per-shard ``.meta.npz`` files then (else the caller does, see
    :func:`drop_shard_meta`)."""
    n = sum(i["num_samples"] for i in infos)
    outs = {k: np.lib.format.open_memmap(tmp / f, mode="w+", dtype=dt, shape=(n,))
            for (k, f), dt in zip(ARRAY_FILES.items(), (np.int32, np.int64, np.uint32))}
    table = np.zeros((len(infos), 4), np.int64)
    for i, info in enumerate(infos):
        a, b = info["first_sample"], info["first_sample"] + info["num_samples"]
        with np.load(_meta_path(tmp, info["shard"])) as z:
            for k in outs:
                outs[k][a:b] = z[k]
        table[i] = (a, info["num_samples"], info["num_tokens"], info["bytes"])
    for arr in outs.values():
        arr.flush()
    del outs
    np.save(tmp / SHARDS_FILE, table)
    if drop_meta:
        drop_shard_meta(tmp, infos)
    index = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "name": name,
        "tokenizer_hash": thash,
        "tokenizer_file": os.path.basename(str(tokenizer)),
        "vocab_size": vocab,
        "eos_id": eos,
        "bos_added_id": bos,  # the id each document starts with (--bos), None: no BOS added
        "token_dtype": dtype.name,
        "num_samples": n,
        "num_tokens": int(table[:, 2].sum()),
        "num_shards": len(infos),
        "skipped_empty_documents": counts.get("empty", 0),
        "skipped_bad_rows": counts.get("bad_rows", 0),
        "first_bad_row": counts.get("first_bad_row"),
        "empty_encoded_documents": sum(i["empty_encoded"] for i in infos),
        "num_files": counts.get("files"),
        "sources": [str(p) for p in paths] if paths else None,
    }
    if extra_meta:
        index["meta"] = extra_meta
    return index
