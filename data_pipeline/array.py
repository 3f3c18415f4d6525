"""``fbt data prepare`` as a job array: N tasks each tokenize a deterministic slice of the input, a final
step merges and verifies; the result is the token stream of a one-process prepare of the same inputs.

Stages (``fbt slurm submit-prepare`` submits them as two SLURM job arrays and one job, chained with
``afterok``; each stage is also a plain function, run in-process by the tests):

* **plan** (where the command runs): the inputs' units in stream order (``sources.list_units``: a JSONL
  or text file, a Parquet row group, an Arrow file of a ``datasets`` save), cut into N contiguous
  slices of about equal bytes on disk, written with the settings and the inputs' sizes and mtimes to
  ``<out>.array/plan.json``.
* **count** (task i): reads slice i and cuts its documents into shards exactly as the tokenize stage
  will (``prepare._shard_tasks``), recording the documents of each shard in ``counts/slice-i.json``.
* **tokenize** (task i): its first sample id and shard number are the sums over the slices before it;
  tokenizes its shards into ``<out>.array/shards/`` under their final numbers and sample ids
  (``prepare._write_shard``), then writes ``done/slice-i.json``.
* **merge**: checks that every slice is done and the shards are contiguous, concatenates the
  per-document arrays (``prepare._write_index``), reads the first and last sample of every shard back
  against the index, and renames the directory to ``<out>``.

Why two reading passes: a task's first sample id depends on how many documents all earlier slices hold;
counting them costs one more read of the input (JSON or Arrow decoding, small beside tokenizing) and lets
every task write its final shards directly, so the merge moves no token data.

What equals the one-process prepare: the documents, their order, sample ids, tokens and metadata, and
``lengths.npy``/``crc32.npy``; shards are cut afresh at each slice's start, so the shard table and
``offsets.npy`` differ, and the loader's stream (which follows sample ids) does not.

Resuming: every stage may run again. A count or tokenize task whose slice is done exits at once; a
tokenize task stopped part-way keeps the shards it finished (a shard is finished when its tar is in
place) and writes only the rest. A plan with other settings, or inputs changed since it was made,
starts over (``write_plan``) or is refused by the task (an input changed under a running array).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np

from .errors import EmptySourceError, SourceError
from .output_dir import OutputDirError, earlier_output
from .prepare import (DATASET_ENTRIES, WRITER, _finished, _shard_tasks, _write_index, drop_shard_meta, exclusive_lock,
                      held_dataset, run_shard_tasks)
from .shards import FORMAT_VERSION, INDEX_FILE, Dataset, DatasetReader, shard_name
from .sources import Unit, expand_paths, fingerprint_files, iter_units, list_units
from .tokenizer import load_tokenizer, resolve_bos, tokenizer_hash

log = logging.getLogger(__name__)

PLAN_FILE = "plan.json"
MERGED_FILE = "merged.json"


def array_dir(out_dir: str | os.PathLike) -> Path:
    out_dir = Path(out_dir)
    return out_dir.with_name(out_dir.name + ".array")


def _write_json(path: Path, obj) -> None:
    """Atomically: a task killed while writing leaves the old file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def split_units(units: list[Unit], num_tasks: int) -> list[list[int]]:
    """Unit indexes of each of ``num_tasks`` contiguous slices of about equal bytes: a unit goes to the
    slice its middle byte falls in (a slice may be empty when one unit outweighs a share)."""
    total = sum(u.nbytes for u in units) or 1
    slices: list[list[int]] = [[] for _ in range(num_tasks)]
    at = 0
    for k, u in enumerate(units):
        mid = at + u.nbytes / 2
        slices[min(num_tasks - 1, int(mid * num_tasks / total))].append(k)
        at += u.nbytes
    return slices


def _fingerprint(sources: list[Path]) -> list:
    out = []
    for source in sources:
        for f in fingerprint_files(source):
            st = f.stat()
            out.append([str(f), st.st_size, st.st_mtime_ns])
    return out


def write_plan(paths: list[str], out_dir: str | os.PathLike, tokenizer: str | os.PathLike, num_tasks: int, *,
               name: str | None = None, shard_bytes: int = 16 << 20, text_field: str = "text",
               id_field: str | None = "id", skip_bad_rows: bool = False, bos: str = "no",
               write: bool = True, overwrite: bool = False) -> tuple[Path, dict, str]:
    """Write (or keep) ``<out>.array/plan.json``; returns ``(array dir, plan, state)`` with state "new"
    (a fresh plan; work left by other settings removed), "resume" (the same plan: finished work is kept)
    or "merged" (the same plan, already merged into ``out_dir``). ``write=False``: the plan and its
    state only, nothing written or removed (a dry run). ``out_dir`` holding another dataset is refused
    unless ``overwrite``, and anything but a dataset always (:mod:`output_dir`), before anything is written."""
    if num_tasks < 1:
        raise SourceError(f"a job array needs at least one task (got {num_tasks})")
    if not paths:
        raise SourceError("no input paths given")
    out_dir = Path(out_dir).resolve()
    sources = expand_paths([str(Path(p).resolve()) for p in paths])
    units = list_units([str(s) for s in sources])
    tokenizer = str(Path(tokenizer).resolve())
    bos_id = resolve_bos(load_tokenizer(tokenizer), bos, tokenizer)  # a bad tokenizer: refused before submitting
    settings = {"format_version": FORMAT_VERSION, "name": name or out_dir.name, "out": str(out_dir),
                "tokenizer": tokenizer, "tokenizer_hash": tokenizer_hash(tokenizer), "shard_bytes": shard_bytes,
                "text_field": text_field, "id_field": id_field, "skip_bad_rows": skip_bad_rows, "bos_added_id": bos_id,
                "paths": [str(Path(p).resolve()) for p in paths], "num_files": len(sources),
                "inputs": _fingerprint(sources), "num_tasks": num_tasks}
    plan = {**settings, "units": [u.as_dict() for u in units], "slices": split_units(units, num_tasks)}
    plan["id"] = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]
    adir = array_dir(out_dir)
    old = _read_json(adir / PLAN_FILE)
    if old is not None and old.get("id") == plan["id"]:
        merged = _read_json(adir / MERGED_FILE)
        done = merged is not None and merged.get("id") == plan["id"] and (out_dir / INDEX_FILE).is_file()
        if done:
            return adir, old, "merged"
        _check_out(out_dir, plan["id"], overwrite)
        return adir, old, "resume"
    _check_out(out_dir, plan["id"], overwrite)
    if not write:
        return adir, plan, "new"
    for sub in ("shards", "counts", "done"):  # another plan's work
        shutil.rmtree(adir / sub, ignore_errors=True)
    (adir / MERGED_FILE).unlink(missing_ok=True)
    _write_json(adir / PLAN_FILE, plan)
    return adir, plan, "new"


def _check_out(out_dir: Path, plan_id: str, overwrite: bool) -> None:
    """Refuse an ``out_dir`` holding anything but a dataset, or (without ``overwrite``) a dataset this plan
    did not merge."""
    if not earlier_output(out_dir, markers=(INDEX_FILE,), patterns=DATASET_ENTRIES, writer=WRITER) or overwrite:
        return
    index = _read_json(out_dir / INDEX_FILE)
    if isinstance(index, dict) and (index.get("prepare") or {}).get("plan") == plan_id:
        return  # a merge of this plan stopped after its move
    raise OutputDirError(f"--out {out_dir} holds {held_dataset(index, by_array=True)}: nothing was changed; "
                         f"pass --overwrite to replace it, or choose another directory")


def load_plan(adir: str | os.PathLike) -> dict:
    path = Path(adir) / PLAN_FILE
    plan = _read_json(path)
    if plan is None:
        raise SourceError(f"{path}: no readable plan (made by `fbt slurm submit-prepare`)")
    return plan


def _slice_file(adir: Path, stage: str, task: int) -> Path:
    return adir / stage / f"slice-{task:05d}.json"


def _task_range(plan: dict, task: int) -> None:
    if not 0 <= task < plan["num_tasks"]:
        raise SourceError(f"task {task} is outside the plan's {plan['num_tasks']} tasks (0..{plan['num_tasks'] - 1})")


def _slice_documents(plan: dict, task: int, counts: dict):
    """Slice ``task``'s documents, after checking that its input files are those the plan saw."""
    units = [Unit(**plan["units"][k]) for k in plan["slices"][task]]
    mine = {u.source for u in units}
    seen = {f: (size, mtime) for f, size, mtime in plan["inputs"]}
    for source in sorted(mine):
        for f in fingerprint_files(Path(source)):
            try:
                st = f.stat()
            except OSError:
                raise SourceError(f"input {f} is gone since the plan was made; submit again") from None
            if seen.get(str(f)) != (st.st_size, st.st_mtime_ns):
                raise SourceError(f"input {f} changed (size or mtime) since the plan was made; submit again "
                                  "(the other tasks read the old one)")
    return iter_units(units, text_field=plan["text_field"], id_field=plan["id_field"], counts=counts,
                      skip_bad_rows=plan["skip_bad_rows"])


def count_slice(adir: str | os.PathLike, task: int) -> dict:
    """Stage 1 of task ``task``: its documents per shard, written to ``counts/slice-i.json`` (kept when
    present for this plan)."""
    adir = Path(adir)
    plan = load_plan(adir)
    _task_range(plan, task)
    path = _slice_file(adir, "counts", task)
    old = _read_json(path)
    if old is not None and old.get("plan") == plan["id"]:
        log.info("slice %d: counted earlier (%s)", task, path)
        return old
    counts: dict = {}
    per_shard = [len(docs) for _, _, docs in _shard_tasks(_slice_documents(plan, task, counts),
                                                          plan["shard_bytes"], counts)]
    rec = {"plan": plan["id"], "task": task, "shard_docs": per_shard, "num_samples": sum(per_shard),
           "empty": counts.get("empty", 0), "bad_rows": counts.get("bad_rows", 0),
           "first_bad_row": counts.get("first_bad_row")}
    _write_json(path, rec)
    return rec


def _counts_before(adir: Path, plan: dict, task: int) -> list[dict]:
    recs = []
    for j in range(task + 1):
        rec = _read_json(_slice_file(adir, "counts", j))
        if rec is None or rec.get("plan") != plan["id"]:
            raise SourceError(f"slice {j} has not been counted ({_slice_file(adir, 'counts', j)} missing or from "
                              "another plan): the count stage must finish before the tokenize stage")
        recs.append(rec)
    return recs


def _check_tokenizer(plan: dict) -> None:
    """The tokenizer files must be the ones the plan was made with: tasks run hours after submission, and
    a dataset tokenized by two tokenizers would train silently wrong."""
    now = tokenizer_hash(plan["tokenizer"])
    if now != plan["tokenizer_hash"]:
        raise SourceError(f"tokenizer {plan['tokenizer']} changed since the plan was made (hash {plan['tokenizer_hash']}, "
                          f"now {now}): restore it, or submit the preparation again")


def tokenize_slice(adir: str | os.PathLike, task: int, num_workers: int = 1) -> dict:
    """Stage 2 of task ``task``: its shards under their final numbers in ``shards/``, with ``num_workers``
    processes; shards finished by an earlier attempt are kept. Writes ``done/slice-i.json``."""
    adir = Path(adir)
    plan = load_plan(adir)
    _task_range(plan, task)
    done_path = _slice_file(adir, "done", task)
    recs = _counts_before(adir, plan, task)
    mine = recs[-1]
    first_shard = sum(len(r["shard_docs"]) for r in recs[:-1])
    first_sample = sum(r["num_samples"] for r in recs[:-1])
    out = adir / "shards"
    out.mkdir(parents=True, exist_ok=True)
    old = _read_json(done_path)
    if old is not None and old.get("plan") == plan["id"] and \
            all(_finished(out, i["shard"], i["num_samples"], i["first_sample"]) for i in old["infos"]):
        log.info("slice %d: tokenized earlier (%s)", task, done_path)
        return old
    _check_tokenizer(plan)
    lock = exclusive_lock(adir / "locks" / f"slice-{task:05d}.lock", f"another process is tokenizing slice {task}")
    try:
        for s in range(first_shard, first_shard + len(mine["shard_docs"])):  # this slice's shards in flight
            for p in out.glob(f"{shard_name(s)}*.part*"):
                p.unlink()
        sp = load_tokenizer(plan["tokenizer"])
        dtype = np.dtype(np.uint16 if sp.vocab_size() <= 65535 else np.int32)
        counts: dict = {}
        expected = mine["shard_docs"]

        def tasks():
            for k, (s, f, docs) in enumerate(_shard_tasks(_slice_documents(plan, task, counts),
                                                          plan["shard_bytes"], counts)):
                if k >= len(expected) or len(docs) != expected[k]:
                    raise SourceError(f"slice {task}: shard {k} holds {len(docs)} documents, the count stage found "
                                      f"{expected[k] if k < len(expected) else 'no such shard'} (input changed?)")
                yield first_shard + s, first_sample + f, docs

        t0, infos, fresh_tokens, kept = time.time(), [], 0, 0
        init = (plan["tokenizer"], str(out), plan["name"], dtype.str, plan["bos_added_id"])
        for info, fresh in run_shard_tasks(tasks(), init, num_workers,
                                           lambda s, n, f: _finished(out, s, n, f)):
            infos.append(info)
            fresh_tokens += info["num_tokens"] if fresh else 0
            kept += not fresh
        if len(infos) != len(expected):
            raise SourceError(f"slice {task}: {len(infos)} shards, the count stage found {len(expected)} (input changed?)")
        seconds = time.time() - t0
        rec = {"plan": plan["id"], "task": task, "infos": infos, "workers": num_workers, "seconds": round(seconds, 3),
               "kept_shards": kept, "tokens": sum(i["num_tokens"] for i in infos),
               "tokens_per_s": round(fresh_tokens / max(seconds, 1e-9))}
        _write_json(done_path, rec)
        log.info("slice %d: %d shards (%d kept from an earlier attempt), %d tokens in %.1fs",
                 task, len(infos), kept, rec["tokens"], seconds)
        return rec
    finally:
        lock.close()


def merge(adir: str | os.PathLike) -> dict:
    """Stage 3: check every slice, write the index, verify it against the shards and move the dataset to
    the plan's output directory; returns the index."""
    adir = Path(adir)
    plan = load_plan(adir)
    out, shards = Path(plan["out"]), adir / "shards"
    missing = [j for j in range(plan["num_tasks"])
               if (_read_json(_slice_file(adir, "done", j)) or {}).get("plan") != plan["id"]]
    if missing:
        raise SourceError(f"slices {missing} are not tokenized ({adir / 'done'}): run their tasks again first")
    recs = _counts_before(adir, plan, plan["num_tasks"] - 1)
    done = [_read_json(_slice_file(adir, "done", j)) for j in range(plan["num_tasks"])]
    infos = [i for d in done for i in d["infos"]]
    aside = out.parent / f".{out.name}.replaced-{plan['id']}"  # an earlier dataset at out, until the move is done
    moved = _read_json(out / INDEX_FILE) if not shards.exists() and out.is_dir() else None
    if moved is not None and moved.get("prepare", {}).get("plan") == plan["id"]:
        return _finish_merge(adir, plan, out, aside, infos, moved)  # a merge stopped after its move
    _check_tokenizer(plan)
    if not infos:
        raise EmptySourceError(f"source {plan['name']!r} is empty: no non-empty documents in {', '.join(plan['paths'])} "
                          f"({sum(r['empty'] for r in recs)} empty skipped)")
    sample = 0
    for k, info in enumerate(infos):
        problem = None
        if info["shard"] != k or info["first_sample"] != sample:
            problem = f"is shard {info['shard']} from sample {info['first_sample']}, expected shard {k} from {sample}"
        elif not _finished(shards, k, info["num_samples"], info["first_sample"]):
            problem = "is missing or its size differs from the one recorded"
        if problem:
            raise SourceError(f"{shards / shard_name(k)} {problem}: run the tasks again")
        sample += info["num_samples"]
    counts = {"empty": sum(r["empty"] for r in recs), "bad_rows": sum(r["bad_rows"] for r in recs),
              "first_bad_row": next((r["first_bad_row"] for r in recs if r["first_bad_row"]), None),
              "files": plan["num_files"]}
    sp = load_tokenizer(plan["tokenizer"])
    dtype = np.dtype(np.uint16 if sp.vocab_size() <= 65535 else np.int32)
    index = _write_index(shards, infos, name=plan["name"], thash=plan["tokenizer_hash"], tokenizer=plan["tokenizer"],
                         vocab=sp.vocab_size(), eos=sp.eos_id(), bos=plan["bos_added_id"], dtype=dtype, counts=counts,
                         paths=plan["paths"],
                         extra_meta=None, drop_meta=False)  # kept until verified: a failed merge can run again
    index["seconds"] = round(max(d["seconds"] for d in done), 3)  # the slowest task
    index["prepare"] = {"array_tasks": plan["num_tasks"], "plan": plan["id"], "workers": max(d["workers"] for d in done),
                        "resumed_shards": sum(d["kept_shards"] for d in done),
                        "tokens_per_s": [d["tokens_per_s"] for d in done]}
    (shards / INDEX_FILE).write_text(json.dumps(index, indent=1))
    _verify(shards)
    # The shards' meta files (what a resumed task reads) go only after the move: a merge stopped before
    # it keeps every finished shard, and one stopped after it is finished by the next merge.
    if earlier_output(out, markers=(INDEX_FILE,), patterns=DATASET_ENTRIES, writer=WRITER):  # else refused
        os.replace(out, aside)  # a dataset (the plan was checked against it when submitted)
    os.replace(shards, out)
    return _finish_merge(adir, plan, out, aside, infos, index)


def _finish_merge(adir: Path, plan: dict, out: Path, aside: Path, infos: list, index: dict) -> dict:
    drop_shard_meta(out, infos)
    _write_json(adir / MERGED_FILE, {"id": plan["id"], "out": str(out), "num_samples": index["num_samples"],
                                     "num_tokens": index["num_tokens"]})
    if aside.exists():
        shutil.rmtree(aside)
    return index


def _verify(path: Path) -> None:
    """The index against the shards: every shard's first and last sample read back (key, length, crc32)."""
    ds = Dataset.load(path)
    reader = DatasetReader(ds)
    try:
        for i in range(ds.num_shards):
            first, n = int(ds.shard_table[i, 0]), int(ds.shard_table[i, 1])
            for sid in {first, first + n - 1}:
                reader.get(sid)  # raises CorruptShardError naming the shard and sample
    finally:
        reader.close()
