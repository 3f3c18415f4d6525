"""Data pipeline throughput on CPU.

* shard writing: tokens/s and MB/s of ``prepare_dataset`` on the Python standard library source
  with 1 and 2 worker processes (alternated ``--write-repeats`` times, best of each kept);
  Wall-clock speed-up needs idle cores: with ``sched_autogroup`` (on here) the kernel shares the CPU
  between sessions, so while other sessions keep the cores busy a second worker in the same session
  gets no extra CPU. ``tokens_per_cpu_s`` (CPU time of the process and its workers) shows the parallel
  overhead independently of other load;
* loader: tokens/s of the streaming loader with one DataLoader worker (DP=1) on the embedded mix;
* the ratio of the loader's rate to what the tiny recipe consumes per second, measured in the same
  run: the recipe's FBT model at its micro-batch shape, 1 pass, forward + backward + AdamW. Steps
  with 2 or 3 passes consume slower, so the real ratio is at least the one printed.

* ``--vs-datatrove``: ``fbt data prepare`` against datatrove's tokenization (``JsonlReader`` ->
  ``DocumentTokenizer`` under its ``LocalPipelineExecutor``, no shuffling), side by side on the same
  JSONL corpus (Python standard library source and docs), the same Hugging Face ``tokenizer.json``
  (a byte-level BPE trained here by ``tokenizers``: nothing is downloaded) and the same cores (the
  process and its workers pinned to ``--cores``, one worker/task per core). Runs alternate between the
  two tools (the machine is shared); the median and the best of each tool's runs are reported: tokens/s
  per core (wall clock / cores) and tokens per CPU-second (the process and its workers: what a core gives
  when it is not shared), and the ratios fbt / datatrove. Both must count the same tokens (no EOS is added by
  either), so they did the same work. Needs ``pip install .[bench]``.

Usage: python benchmarks/bench_data.py [--out data/embedded] [--seq-length 256] [--micro-batch 8]
       [--consumer-tokens-per-s N] [--json results.json]
       python benchmarks/bench_data.py --vs-datatrove [--corpus-mb 24] [--doc-chars 4000] [--vocab-size 32000] [--cores 0]
       [--repeats 3] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


import numpy as np
import torch

from data_pipeline.config import DataConfig
from data_pipeline.embedded import build_embedded, code_documents, stdlib_files
from data_pipeline.loader import build_loader
from data_pipeline.prepare import prepare_dataset


def _cpu_seconds() -> float:
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def bench_write(tokenizer: str, workers: int, mb: float, shard_mb: float) -> dict:
    docs = list(code_documents(stdlib_files(), int(mb * 1e6), seed=0))
    nbytes = sum(len(t.encode()) for _, t in docs)
    with tempfile.TemporaryDirectory() as tmp:
        cpu0 = _cpu_seconds()
        t0 = time.perf_counter()
        idx = prepare_dataset([], Path(tmp) / "code", tokenizer, name="code", shard_bytes=int(shard_mb * (1 << 20)),
                              num_workers=workers, progress=False, documents=iter(docs))
        dt = time.perf_counter() - t0
        cpu = _cpu_seconds() - cpu0
        shard_bytes = sum(f.stat().st_size for f in (Path(tmp) / "code").glob("shard-*.tar"))
    return {"workers": workers, "seconds": round(dt, 2), "tokens": idx["num_tokens"], "shards": idx["num_shards"],
            "tokens_per_s": round(idx["num_tokens"] / dt), "text_MB_per_s": round(nbytes / dt / 1e6, 2),
            "shard_MB_per_s": round(shard_bytes / dt / 1e6, 2),
            # CPU time of this process and its (finished) worker processes: independent of other load
            "cpu_seconds": round(cpu, 2), "tokens_per_cpu_s": round(idx["num_tokens"] / max(cpu, 1e-9))}


def _corpus_jsonl(root: Path, mb: float, files: int, doc_chars: int) -> int:
    """``files`` JSONL files of Python standard library documents (code and docs), ``mb`` MB of text, cut at
    line ends into documents of about ``doc_chars`` characters (web corpora's documents are a few
    thousand characters: per-document costs count as they would there)."""
    docs = []
    for doc_id, text in code_documents(stdlib_files(), int(mb * 1e6), seed=0):
        piece, n = [], 0
        for line in text.splitlines(keepends=True):
            piece.append(line)
            n += len(line)
            if n >= doc_chars:
                docs.append((f"{doc_id}#{len(docs)}", "".join(piece)))
                piece, n = [], 0
        if piece:
            docs.append((f"{doc_id}#{len(docs)}", "".join(piece)))
    root.mkdir(parents=True, exist_ok=True)
    for k in range(files):
        with open(root / f"part-{k:03d}.jsonl", "w") as fh:
            for doc_id, text in docs[k::files]:
                fh.write(json.dumps({"text": text, "id": doc_id}) + "\n")
    return len(docs)


def _run_fbt(corpus: Path, tok: Path, out: Path, workers: int) -> dict:
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    idx = prepare_dataset([str(corpus)], out, tok, name="bench", num_workers=workers, progress=False)
    return {"tool": "fbt", "seconds": time.perf_counter() - t0, "cpu_seconds": _cpu_seconds() - cpu0,
            "tokens": idx["num_tokens"], "documents": idx["num_samples"]}


def _run_datatrove(corpus: Path, tok: Path, out: Path, workers: int) -> dict:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens import DocumentTokenizer

    pipeline = [JsonlReader(str(corpus), text_key="text", id_key="id"),
                DocumentTokenizer(str(out / "tokens"), str(tok / "tokenizer.json"), eos_token=None,
                                  shuffle_documents=False, save_final_metadata=False)]
    # fork: the workers are this process's children, so their CPU time is counted (RUSAGE_CHILDREN)
    executor = LocalPipelineExecutor(pipeline, tasks=workers, workers=workers, logging_dir=str(out / "logs"),
                                     start_method="fork", skip_completed=False)
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    stats = executor.run()
    seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    tokens = sum(np.fromfile(f, np.uint16).size for f in (out / "tokens").glob("*.ds"))
    del stats
    return {"tool": "datatrove", "seconds": seconds, "cpu_seconds": cpu, "tokens": int(tokens)}


def bench_vs_datatrove(a) -> dict:
    """fbt data prepare vs datatrove, same corpus, tokenizer and cores (the module docstring)."""
    import datatrove
    import tokenizers

    from harness import repo_module

    train_hf_bpe = repo_module("tests/support/data_fixtures.py").train_hf_bpe

    cores = sorted(int(c) for c in a.cores.split(","))
    os.sched_setaffinity(0, cores)  # this process, its workers and the tokenizers' Rayon pool
    workers = len(cores)
    res = {"cores": cores, "workers": workers, "corpus_mb": a.corpus_mb, "doc_chars": a.doc_chars,
           "vocab_size": a.vocab_size,
           "datatrove_version": getattr(datatrove, "__version__", None) or _version("datatrove"),
           "tokenizers": tokenizers.__version__, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        res["documents"] = _corpus_jsonl(tmp / "corpus", a.corpus_mb, files=max(4, workers), doc_chars=a.doc_chars)
        texts = (json.loads(line)["text"] for f in sorted((tmp / "corpus").glob("*.jsonl")) for line in open(f))
        tok = train_hf_bpe(texts, tmp / "tok", vocab_size=a.vocab_size)
        res["tokenizer_vocab"] = a.vocab_size
        for r in range(a.repeats):
            for tool, fn in (("fbt", _run_fbt), ("datatrove", _run_datatrove)) if r % 2 == 0 else \
                    (("datatrove", _run_datatrove), ("fbt", _run_fbt)):
                out = tmp / f"{tool}-{r}"
                run = fn(tmp / "corpus", tok, out, workers)
                shutil.rmtree(out, ignore_errors=True)
                run.update(tokens_per_s_per_core=round(run["tokens"] / run["seconds"] / workers),
                           tokens_per_cpu_s=round(run["tokens"] / max(run["cpu_seconds"], 1e-9)),
                           seconds=round(run["seconds"], 2), cpu_seconds=round(run["cpu_seconds"], 2))
                res["runs"].append(run)
                print(f"  {tool:9s} run {r}: {run['tokens']:,} tokens in {run['seconds']} s "
                      f"({run['tokens_per_s_per_core']:,} tokens/s per core, {run['tokens_per_cpu_s']:,} per CPU-s)",
                      file=sys.stderr)
    for tool in ("fbt", "datatrove"):
        runs = [r for r in res["runs"] if r["tool"] == tool]
        res[tool] = {"tokens": runs[0]["tokens"], **{f"{stat}_{key}": round(fn(r[key] for r in runs))
                     for key in ("tokens_per_s_per_core", "tokens_per_cpu_s")
                     for stat, fn in (("median", statistics.median), ("best", max))}}
    if res["fbt"]["tokens"] != res["datatrove"]["tokens"]:
        raise SystemExit(f"the tools counted different tokens ({res['fbt']['tokens']} vs {res['datatrove']['tokens']}):"
                         " not the same work")
    for stat in ("median", "best"):
        for key, short in (("tokens_per_s_per_core", "per_core"), ("tokens_per_cpu_s", "per_cpu_s")):
            res[f"ratio_{short}_{stat}"] = round(res["fbt"][f"{stat}_{key}"] / res["datatrove"][f"{stat}_{key}"], 3)
    res["goal_ratio"] = 1.0
    return res


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def bench_loader(cfg: DataConfig, mb: int, gb: int, seconds: float, workers: int) -> dict:
    cfg = cfg.model_copy(update={"num_workers": workers})
    ld = build_loader(cfg, micro_batch_size=mb, global_batch_size=gb, dp_rank=0, dp_size=1)
    for _ in range(20):  # warm up (worker start)
        next(ld)
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        b = next(ld)
        n += b["input_ids"].numel()
    dt = time.perf_counter() - t0
    ld.close()
    return {"workers": workers, "tokens_per_s": round(n / dt), "tokens": n, "seconds": round(dt, 2)}


def bench_consumer(recipe_path: Path, steps: int = 6) -> tuple[float, dict]:
    """Tokens/s the tiny recipe's FBT model consumes: its micro-batch shape, 1 pass (the fastest
    step, so the printed ratio is a lower bound), forward + backward + AdamW, on this machine."""
    os.environ.setdefault("FBT_DEVICE", "cpu")
    from fbt_megatron import runtime
    from fbt_megatron.model.fbt_gpt import build_model
    from fbt_megatron.recipe import load_recipe

    recipe = load_recipe(recipe_path)
    runtime.init_distributed()
    runtime.init_parallel_state(runtime.ParallelLayout(), seed=0)
    model = build_model(recipe.model, recipe.feedback)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mb, seq, vocab = recipe.batch.micro_batch_size, recipe.data.seq_length, recipe.model.vocab_size
    x, y = torch.randint(0, vocab, (mb, seq)), torch.randint(0, vocab, (mb, seq))

    def step():
        opt.zero_grad()
        model(x, labels=y, num_passes=1, jitter_seed=0).token_loss.mean().backward()
        opt.step()

    step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    rate = steps * mb * seq / (time.perf_counter() - t0)
    runtime.shutdown()
    return rate, {"micro_batch": mb, "seq_length": seq}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data/embedded")
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--write-mb", type=float, default=3.0, help="MB of stdlib source for the write benchmark")
    p.add_argument("--write-shard-mb", type=float, default=0.25, help="shard size of the write benchmark "
                   "(the work is split by shard: several shards are needed to use 2 workers)")
    p.add_argument("--only-write", action="store_true", help="only the shard-writing benchmark")
    p.add_argument("--write-repeats", type=int, default=2, help="alternating 1/2-worker write runs (best kept)")
    p.add_argument("--consumer-tokens-per-s", type=float, default=None)
    p.add_argument("--recipe", default=str(Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml"))
    p.add_argument("--json", default=None)
    p.add_argument("--vs-datatrove", action="store_true", help="only fbt data prepare vs datatrove's tokenization")
    p.add_argument("--corpus-mb", type=float, default=24.0, help="--vs-datatrove: MB of JSONL text")
    p.add_argument("--doc-chars", type=int, default=4000, help="--vs-datatrove: characters per document (about)")
    p.add_argument("--vocab-size", type=int, default=32000, help="--vs-datatrove: BPE vocabulary trained here")
    p.add_argument("--cores", default="0", help="--vs-datatrove: CPU ids both tools run on (one worker each)")
    p.add_argument("--repeats", type=int, default=3, help="--vs-datatrove: runs of each tool, alternating")
    a = p.parse_args(argv)

    if a.vs_datatrove:
        res = bench_vs_datatrove(a)
        print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))
        for tool in ("fbt", "datatrove"):
            r = res[tool]
            print(f"{tool:9s}: {r['median_tokens_per_s_per_core']:,} tokens/s per core (best {r['best_tokens_per_s_per_core']:,}), "
                  f"{r['median_tokens_per_cpu_s']:,} tokens per CPU-second (best {r['best_tokens_per_cpu_s']:,}); "
                  f"medians of {a.repeats} runs, {r['tokens']:,} tokens on {res['workers']} core(s)")
        print(f"fbt / datatrove: {res['ratio_per_core_median']}x per core, {res['ratio_per_cpu_s_median']}x per "
              f"CPU-second (medians; best runs: {res['ratio_per_core_best']}x, {res['ratio_per_cpu_s_best']}x; goal >= 1.0)")
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
        return 0

    data = build_embedded(a.out, seq_length=a.seq_length, progress=False, log=lambda m: print(m, file=sys.stderr))
    cfg = DataConfig(**{**data, "seq_length": a.seq_length})
    res = {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    # alternate 1 and 2 workers (the machine is shared: load changes during the run), keep each best
    runs = [bench_write(cfg.tokenizer, w, a.write_mb, a.write_shard_mb) for _ in range(a.write_repeats) for w in (1, 2)]
    res["write_runs"] = runs
    res["write"] = [max((r for r in runs if r["workers"] == w), key=lambda r: r["tokens_per_s"]) for w in (1, 2)]
    res["write_speedup_2_over_1"] = round(res["write"][1]["tokens_per_s"] / res["write"][0]["tokens_per_s"], 2)
    if a.only_write:
        print(json.dumps(res, indent=1))
        for w in res["write"]:
            print(f"shard writing ({w['workers']} proc): {w['tokens_per_s']:,} tokens/s ({w['tokens_per_cpu_s']:,} "
                  f"tokens per CPU-second)")
        print(f"2 workers / 1 worker: {res['write_speedup_2_over_1']}x")
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
        return 0
    res["loader"] = bench_loader(cfg, a.micro_batch, a.global_batch, a.seconds, workers=1)
    res["loader_in_process"] = bench_loader(cfg, a.micro_batch, a.global_batch, a.seconds, workers=0)
    if a.consumer_tokens_per_s:
        consumer, how = a.consumer_tokens_per_s, "given"
    else:
        consumer, shape = bench_consumer(Path(a.recipe))
        how = f"{Path(a.recipe).name} FBT model, 1 pass fwd+bwd+AdamW, micro batch {shape['micro_batch']}x{shape['seq_length']}"
    res["consumer"] = {"tokens_per_s": round(consumer), "how": how}
    res["ratio_loader_over_consumer"] = round(res["loader"]["tokens_per_s"] / consumer, 1)
    res["goal_ratio"] = 50
    print(json.dumps(res, indent=1))
    for w in res["write"]:
        print(f"shard writing ({w['workers']} proc): {w['tokens_per_s']:,} tokens/s, {w['text_MB_per_s']} MB text/s "
              f"({w['tokens_per_cpu_s']:,} tokens per CPU-second)")
    print(f"2 workers / 1 worker: {res['write_speedup_2_over_1']}x")
    print(f"loader (1 worker): {res['loader']['tokens_per_s']:,} tokens/s; in-process: "
          f"{res['loader_in_process']['tokens_per_s']:,} tokens/s")
    print(f"tiny recipe consumes ~{res['consumer']['tokens_per_s']:,} tokens/s ({how}); "
          f"ratio {res['ratio_loader_over_consumer']}x (goal >= 50x)")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
