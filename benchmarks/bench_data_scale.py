"""The data loader at scale: memory, start-up and cursor time for 10^6 / 10^7 / 10^8 documents.

For each size it synthesises a dataset index (format version 2: ``lengths.npy``, ``offsets.npy``,
``crc32.npy`` written in chunks through numpy memmaps, a shard table, empty placeholder shard files:
lengths only, no token bytes), mixes it with a small second source (token shares 0.7 / 0.3), and in a
fresh process per size measures:

* start-up: ``build_loader`` (rank 0 of DP 8) — wall time and bytes read by ``read()`` calls
  (``/proc/self/io`` rchar; memory-mapped pages are not read by ``read()``);
* memory after start-up, after building the valid loader too, and after planning 200 micro-batches
  (``planner.pieces``, the arithmetic of a micro-batch; shards are not read), from
  ``/proc/self/smaps_rollup``: private anonymous memory (``Anonymous``) per process, and file-backed
  resident memory (page cache, shared by the processes of a node), split into the index's memory maps
  (from ``/proc/self/smaps``) and everything else (shared libraries);
* cursor deep in the run: ``build_loader(state=...)`` with a cursor in epoch 3 of the big source,
  plus ``state_dict()`` one step later (the resume path: O(1) in the depth);
* the fallback ``consumed_sequences``-only resume walks the stream from 0: its rate in documents/s.

Goals: start-up < 5 s and private (anonymous) memory < 200 MB per process, flat in the number of
documents. The synthesised files are deleted at the end (``--keep`` keeps them).

Usage: python benchmarks/bench_data_scale.py [--sizes 1e6 1e7 1e8] [--dir /tmp/fbt_scale] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import numpy as np  # noqa: E402

DOCS_PER_SHARD = 16384  # ~16M tokens per shard at 1000 tokens per document
CHUNK = 610 * DOCS_PER_SHARD  # ~10^7 documents, whole shards per chunk


def synthesise(out: Path, n: int, thash: str, seed: int = 0) -> None:
    """A format-2 index of ``n`` documents (lengths ~ 1000 tokens on average), written in chunks."""
    from data_pipeline.shards import ARRAY_FILES, FORMAT, FORMAT_VERSION, SHARDS_FILE, shard_name

    if (out / "index.json").is_file():
        return
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    lengths = np.lib.format.open_memmap(tmp / ARRAY_FILES["lengths"], "w+", np.int32, (n,))
    offsets = np.lib.format.open_memmap(tmp / ARRAY_FILES["offsets"], "w+", np.int64, (n,))
    crc = np.lib.format.open_memmap(tmp / ARRAY_FILES["crc32"], "w+", np.uint32, (n,))
    n_shards = -(-n // DOCS_PER_SHARD)
    shard_tokens = np.zeros(n_shards, np.int64)
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        ln = np.clip(rng.lognormal(6.5, 0.8, b - a), 1, 60000).astype(np.int32)  # mean ~ 920 tokens
        lengths[a:b] = ln
        shard = np.arange(a, b) // DOCS_PER_SHARD
        per = 2 * ln.astype(np.int64) + 2048  # fake byte sizes: tokens + tar headers
        start_in_chunk = np.cumsum(per) - per
        first = np.flatnonzero(np.diff(shard, prepend=-1))  # first document of each shard in the chunk
        offsets[a:b] = start_in_chunk - np.repeat(start_in_chunk[first], np.diff(np.append(first, b - a)))
        crc[a:b] = 0
        np.add.at(shard_tokens, shard, ln)
    for arr in (lengths, offsets, crc):
        arr.flush()
    table = np.zeros((n_shards, 4), np.int64)
    table[:, 0] = np.arange(n_shards) * DOCS_PER_SHARD
    table[:, 1] = np.minimum(DOCS_PER_SHARD, n - table[:, 0])
    table[:, 2] = shard_tokens
    table[:, 3] = 1 << 26
    np.save(tmp / SHARDS_FILE, table)
    for i in range(n_shards):
        (tmp / shard_name(i)).touch()  # placeholders: start-up lists the directory, never reads them
    index = {"format": FORMAT, "format_version": FORMAT_VERSION, "name": out.name, "tokenizer_hash": thash,
             "tokenizer_file": "tok.model", "vocab_size": 320, "eos_id": 2, "token_dtype": "uint16",
             "num_samples": n, "num_tokens": int(shard_tokens.sum()), "num_shards": n_shards,
             "skipped_empty_documents": 0, "synthetic": True}
    (tmp / "index.json").write_text(json.dumps(index))
    del lengths, offsets, crc
    os.replace(tmp, out)


def memory(prefix: str) -> dict:
    """Private anonymous and file-backed resident memory (MB); the part mapped from files under prefix."""
    roll = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        k, v = line.split(":")
        roll[k] = int(v.split()[0])
    index_rss, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5:  # a mapping header line
            inside = line.split()[-1].startswith(prefix)
        elif inside and line.startswith("Rss:"):
            index_rss += int(line.split()[1])
    return {"anonymous_MB": round(roll["Anonymous"] / 1024, 1),
            "private_MB": round((roll["Private_Clean"] + roll["Private_Dirty"]) / 1024, 1),
            "file_backed_MB": round((roll["Rss"] - roll["Anonymous"]) / 1024, 1),
            "index_maps_resident_MB": round(index_rss / 1024, 1)}


def rchar() -> int:
    return int(next(ln for ln in Path("/proc/self/io").read_text().splitlines() if ln.startswith("rchar")).split()[1])


def measure(cfg_json: str, prefix: str) -> dict:
    """Runs in a fresh process: start-up, memory, deep cursor, walk rate."""
    import torch  # noqa: F401  (the trainer's process has it imported: count its memory in the baseline)

    from data_pipeline.config import DataConfig
    from data_pipeline.loader import build_loader, planner_for
    from data_pipeline.stream import BLOCK

    cfg = DataConfig.model_validate_json(cfg_json)
    kw = dict(micro_batch_size=4, global_batch_size=256, dp_rank=0, dp_size=8)
    res = {"baseline": memory(prefix)}
    r0, t0 = rchar(), time.perf_counter()
    ld = build_loader(cfg, **kw)
    res["startup_s"] = round(time.perf_counter() - t0, 3)
    res["startup_read_bytes"] = rchar() - r0
    res["after_startup"] = memory(prefix)
    t0 = time.perf_counter()
    valid = build_loader(cfg, split="valid", **kw)
    res["valid_startup_s"] = round(time.perf_counter() - t0, 3)
    res["valid_shares_maps"] = all(a is b for a, b in zip(ld._spec.datasets, valid._spec.datasets))
    # plan 200 micro-batches (what a packer computes before reading shards)
    planner = ld._spec.new_planner()
    t0 = time.perf_counter()
    for u in range(200):
        a = ld._spec.position(ld._spec.first_sequence(u))
        planner.pieces(a, a + 4 * cfg.seq_length + 1)
    res["plan_200_micro_batches_s"] = round(time.perf_counter() - t0, 3)
    res["after_planning"] = memory(prefix)
    # a cursor deep in the run: epoch 3 of the big source (a consistent synthetic cursor)
    n_big = ld._spec.datasets[0].num_samples
    b = (3 * n_big + n_big // 3) // BLOCK
    src = planner.block_sources(b)
    share = np.bincount(src, minlength=2) / BLOCK
    per_source = (b * BLOCK * share).astype(np.int64)
    state = dict(ld.state_dict(), doc_index=int(per_source.sum()), doc_offset=0,
                 per_source_consumed={s.name: int(k) for s, k in zip(cfg.sources, per_source)},
                 consumed_sequences=10**9, token_position=10**9 * cfg.seq_length)
    t0 = time.perf_counter()
    deep = build_loader(cfg, state=state, **kw)
    a = deep._spec.position(deep._spec.first_sequence(0))
    deep._spec.new_planner().pieces(a, a + 4 * cfg.seq_length + 1)
    deep._yielded = deep.micro_batches_per_step  # one step consumed
    st = deep.state_dict()
    res["deep_cursor_s"] = round(time.perf_counter() - t0, 3)
    res["deep_cursor_doc_index"] = st["doc_index"]
    res["after_deep_cursor"] = memory(prefix)
    # the consumed_sequences-only fallback walks the stream from position 0
    walker = planner_for(cfg, datasets=ld._spec.datasets)
    walker.reset()
    t0 = time.perf_counter()
    blocks = 0
    while time.perf_counter() - t0 < 3.0:
        walker._next_block()
        walker._blocks = walker._blocks[-1:]
        blocks += 1
    res["walk_docs_per_s"] = round(blocks * BLOCK / (time.perf_counter() - t0))
    res["final"] = memory(prefix)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", type=float, default=[1e6, 1e7, 1e8])
    p.add_argument("--dir", default="/tmp/fbt_data_scale")
    p.add_argument("--keep", action="store_true", help="keep the synthesised indexes")
    p.add_argument("--json", default=None)
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._child:
        cfg_json, prefix = json.loads(a._child)
        print(json.dumps(measure(cfg_json, prefix)))
        return 0

    from data_pipeline.config import DataConfig, SourceConfig
    from data_pipeline.tokenizer import train_tokenizer

    root = Path(a.dir)
    root.mkdir(parents=True, exist_ok=True)
    tok = root / "tok.model"
    if not tok.is_file():
        words = "the of and to in is that for it as was with be by on not data token stream shard".split()
        rng = np.random.default_rng(0)
        train_tokenizer([" ".join(rng.choice(words, 50)) for _ in range(2000)], tok, vocab_size=320, num_threads=1)
    from data_pipeline.tokenizer import tokenizer_hash

    thash = tokenizer_hash(tok)
    small = root / "small"
    synthesise(small, 100_000, thash, seed=1)
    results = {}
    try:
        for size in a.sizes:
            n = int(size)
            d = root / f"docs_{n}"
            t0 = time.perf_counter()
            synthesise(d, n, thash)
            made = time.perf_counter() - t0
            cfg = DataConfig(tokenizer=str(tok), seq_length=4096, sources=[
                SourceConfig(name=d.name, path=str(d), weight=0.7), SourceConfig(name="small", path=str(small), weight=0.3)])
            child = [sys.executable, __file__, "--_child", json.dumps([cfg.model_dump_json(), str(root)])]
            out = subprocess.run(child, capture_output=True, text=True, cwd=ROOT)
            if out.returncode:
                print(out.stderr, file=sys.stderr)
                return 1
            r = json.loads(out.stdout.strip().splitlines()[-1])
            r["synthesise_s"] = round(made, 1)
            r["index_MB_on_disk"] = round(sum(f.stat().st_size for f in d.glob("*.npy")) / 1e6, 1)
            results[n] = r
            m = r["after_deep_cursor"]
            print(f"{n:>11,} docs: start-up {r['startup_s']:.2f}s (read() {r['startup_read_bytes'] / 1e3:.0f} kB), "
                  f"anonymous {m['anonymous_MB']:.0f} MB (baseline {r['baseline']['anonymous_MB']:.0f} MB after "
                  f"imports), index maps resident {m['index_maps_resident_MB']:.1f} MB of "
                  f"{r['index_MB_on_disk']:.0f} MB, deep cursor {r['deep_cursor_s'] * 1e3:.0f} ms, "
                  f"walk {r['walk_docs_per_s']:,} docs/s", flush=True)
            if not a.keep:
                shutil.rmtree(d)
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    anon = [r["after_deep_cursor"]["anonymous_MB"] for r in results.values()]
    summary = {"goal_startup_s": 5, "goal_anonymous_MB": 200,
               "max_startup_s": max(r["startup_s"] for r in results.values()), "max_anonymous_MB": max(anon),
               "anonymous_spread_MB": round(max(anon) - min(anon), 1)}
    print(json.dumps({"results": results, "summary": summary}, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps({"results": results, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
