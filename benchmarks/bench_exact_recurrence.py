"""The exact recurrence over validation rows: ``seq_length`` Jacobi passes of the whole rows (what the
study's read-out ran) against each document decoded through the KV cache
(``fbt_megatron.generate.recurrence``), side by side on the same rows, with the largest logit difference.
Then the validation loss through the cache over ``--loss-rows`` rows in micro-batches of ``--micro-batch``:
decoded a micro-batch at a time (what the read-out ran up to 2026-12-06) against ``--rows-at-once`` rows
at a time (default: as many as ``recurrence.LOGITS_AT_ONCE`` holds), side by side, with the two losses.

The model is the research recipe's tiny one at its initialisation (the cost does not depend on the
weights); rows of ``--seq`` tokens hold documents of random lengths around ``--doc-length``.

Usage: python benchmarks/bench_exact_recurrence.py [--rows 16] [--seq 128] [--doc-length 40] [--repeats 2]
           [--loss-rows 256] [--micro-batch 8] [--rows-at-once N] [--skip-jacobi]
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
    ap.add_argument("--loss-rows", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--rows-at-once", type=int, default=None, help="default: as many as the logit budget holds")
    ap.add_argument("--skip-jacobi", action="store_true")
    a = ap.parse_args(argv)

    from fbt_megatron import runtime
    from fbt_megatron.config import FeedbackConfig, ModelConfig
    from fbt_megatron.generate.model import build_inference_model
    from fbt_megatron.generate.recurrence import document_recurrence_logits, exact_recurrence_loss

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

    print(f"{torch.get_num_threads()} threads, documents ~{a.doc_length} tokens, rows of {a.seq}")
    if not a.skip_jacobi:
        times = side_by_side({"Jacobi, seq passes": jacobi, "documents through the cache": cached}, a.repeats)
        diff = float((times["Jacobi, seq passes"][1].float() - times["documents through the cache"][1]).abs().max())
        report(f"{a.rows} rows", times, f"largest logit difference {diff:.1e}")

    rows = torch.randint(0, cfg.vocab_size, (a.loss_rows, a.seq + 1), generator=g)
    starts = torch.rand(a.loss_rows, a.seq, generator=g) < 1.0 / a.doc_length
    batches = [{"input_ids": rows[i:i + a.micro_batch, :-1], "labels": rows[i:i + a.micro_batch, 1:],
                "loss_mask": torch.ones(len(rows[i:i + a.micro_batch]), a.seq), "doc_start": starts[i:i + a.micro_batch]}
               for i in range(0, a.loss_rows, a.micro_batch)]
    times = side_by_side({f"a micro-batch ({a.micro_batch} rows) at a time":
                          lambda: exact_recurrence_loss(model, batches, rows_at_once=a.micro_batch),
                          f"{a.rows_at_once or 'the budget of'} rows at a time":
                          lambda: exact_recurrence_loss(model, batches, rows_at_once=a.rows_at_once)}, a.repeats)
    losses = " / ".join(f"{t[1]:.9f}" for t in times.values())
    report(f"the validation loss over {a.loss_rows} rows", times, f"losses {losses}")
    runtime.shutdown()
    return 0


def side_by_side(variants: dict, repeats: int) -> dict[str, tuple[list[float], object]]:
    """``{name: (seconds per repeat, last result)}``, the variants alternating within each repeat."""
    out = {name: ([], None) for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            result = fn()
            out[name] = (out[name][0] + [time.perf_counter() - t0], result)
    return out


def report(what: str, times: dict, note: str) -> None:
    print(what)
    for name, (t, _) in times.items():
        print(f"  {name:>40}: {statistics.median(t):.2f} s (median of {len(t)})")
    slow, fast = (statistics.median(t) for t, _ in times.values())
    print(f"  ratio: {slow / fast:.1f}x; {note}")


if __name__ == "__main__":
    sys.exit(main())
