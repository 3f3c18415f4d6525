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

Usage: python benchmarks/bench_data.py [--out data/embedded] [--seq-length 256] [--micro-batch 8]
       [--consumer-tokens-per-s N] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from data_pipeline.config import DataConfig  # noqa: E402
from data_pipeline.embedded import build_embedded, code_documents, stdlib_files  # noqa: E402
from data_pipeline.loader import build_loader  # noqa: E402
from data_pipeline.prepare import prepare_dataset  # noqa: E402


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
    a = p.parse_args(argv)

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
