"""The exact recurrence over validation rows: ``seq_length`` Jacobi passes of the whole rows (what the
study's read-out ran) against each document decoded through the KV cache
(``fbt_megatron.generate.recurrence``), side by side on the same rows, with the largest logit difference.

The model is the research recipe's tiny one at its initialisation (the cost does not depend on the
weights); rows of ``--seq`` tokens hold documents of random lengths around ``--doc-length``.

Usage: python benchmarks/bench_exact_recurrence.py [--rows 16] [--seq 128] [--doc-length 40] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--doc-length", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args(argv)

    from fbt_megatron import runtime
    from fbt_megatron.config import FeedbackConfig, ModelConfig
    from fbt_megatron.generate.model import build_inference_model
    from fbt_megatron.generate.recurrence import document_recurrence_logits

    runtime.init_distributed()
    runtime.init_parallel_state(runtime.ParallelLayout(), seed=1234)
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, vocab_size=4096,
                      max_sequence_length=a.seq)
    model = build_inference_model(cfg, FeedbackConfig(jitter_std=0.0))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (a.rows, a.seq), generator=g)
    doc_start = torch.rand(a.rows, a.seq, generator=g) < 1.0 / a.doc_length

    def jacobi():
        with torch.no_grad():
            return model(ids, doc_start=doc_start, num_passes=a.seq).logits[..., :cfg.vocab_size]

    def cached():
        return document_recurrence_logits(model, ids, doc_start)

    times: dict[str, list[float]] = {"Jacobi, seq passes": [], "documents through the cache": []}
    out = {}
    for _ in range(a.repeats):
        for name, fn in zip(times, (jacobi, cached)):
            t0 = time.perf_counter()
            out[name] = fn()
            times[name].append(time.perf_counter() - t0)
    diff = float((out["Jacobi, seq passes"].float() - out["documents through the cache"]).abs().max())
    print(f"{a.rows} rows x {a.seq} tokens, documents ~{a.doc_length} tokens, {torch.get_num_threads()} threads")
    for name, t in times.items():
        print(f"  {name:>30}: {statistics.median(t):.2f} s (median of {len(t)})")
    slow, fast = (statistics.median(t) for t in times.values())
    print(f"  ratio: {slow / fast:.1f}x; largest logit difference {diff:.1e}")
    runtime.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
