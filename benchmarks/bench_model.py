"""FBT step-time overheads, measured side by side in one run on this machine.

Prints:
- FBT 1-pass train-step time / plain Megatron-Core GPTModel train-step time at the same size
  (goal <= 1.02: pass 1 is the plain transformer and computes no fusion; later passes add two
  D x D matmuls per token);
- k-pass step time / (k x 1-pass step time) for k = 2, 3 (goal <= 1.05).

A train step = forward + backward + AdamW step. Timings are interleaved round-robin and the median
is reported, so drift in machine load hits every variant alike.
Usage: python benchmarks/bench_model.py [--layers 4 --hidden 256 --seq 256 --batch 4 --repeats 7]
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("FBT_DEVICE", "cpu")

import torch  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402

from fbt_megatron import runtime  # noqa: E402
from fbt_megatron.config import FeedbackConfig, ModelConfig  # noqa: E402
from fbt_megatron.model.attention import adapt_layer_spec  # noqa: E402
from fbt_megatron.model.fbt_gpt import build_model, layer_spec  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    runtime.init_distributed()
    runtime.init_parallel_state(runtime.ParallelLayout())
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      vocab_size=args.vocab, max_sequence_length=args.seq)
    dev = runtime.device()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)
    positions = torch.arange(args.seq, device=dev).expand(args.batch, -1)
    doc_start = torch.zeros_like(ids, dtype=torch.bool)
    mask = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool, device=dev), 1)[None, None]

    # Like for like with the plain GPT's causal mask; the document-causal default is timed separately.
    fbt = build_model(cfg.model_copy(update={"attention_mask": "causal"}), FeedbackConfig())
    torch.manual_seed(0)
    fbt_doc = build_model(cfg, FeedbackConfig())
    doc_rows = doc_start.clone()
    doc_rows[:, args.seq // 2] = True  # two documents per row
    # the same layers as the FBT model (the local spec with its SDPA core attention): like for like
    spec = adapt_layer_spec(layer_spec(cfg), "causal", cfg.num_layers)
    plain = GPTModel(config=fbt.config, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                     max_sequence_length=cfg.max_sequence_length, position_embedding_type="rope",
                     share_embeddings_and_output_weights=True).to(dev)
    opts = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (fbt, fbt_doc, plain)}

    def step(model, fn):
        opt = opts[id(model)]
        opt.zero_grad(set_to_none=True)
        fn().mean().backward()
        opt.step()

    variants = {
        "plain GPT": lambda: step(plain, lambda: plain(ids, positions, mask, labels=labels)),
        "FBT k=1": lambda: step(fbt, lambda: fbt(ids, positions, doc_start, labels, num_passes=1, jitter_seed=1).token_loss),
        "FBT k=2": lambda: step(fbt, lambda: fbt(ids, positions, doc_start, labels, num_passes=2, jitter_seed=1).token_loss),
        "FBT k=3": lambda: step(fbt, lambda: fbt(ids, positions, doc_start, labels, num_passes=3, jitter_seed=1).token_loss),
        "FBT k=1 doc": lambda: step(fbt_doc, lambda: fbt_doc(ids, None, doc_rows, labels, num_passes=1, jitter_seed=1).token_loss),
    }
    times = {name: [] for name in variants}
    for fn in variants.values():  # warm-up
        fn()
    for _ in range(args.repeats):
        for name, fn in variants.items():
            if runtime.use_cuda():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if runtime.use_cuda():
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"device={dev} threads={torch.get_num_threads()} layers={args.layers} hidden={args.hidden} "
          f"seq={args.seq} batch={args.batch} vocab={args.vocab} repeats={args.repeats}")
    for name, t in med.items():
        print(f"  {name:12s} median step {t * 1000:8.1f} ms")
    print(f"FBT 1-pass / plain GPT          = {med['FBT k=1'] / med['plain GPT']:.3f}  (goal <= 1.02)")
    for k in (2, 3):
        print(f"FBT {k}-pass / ({k} x FBT 1-pass)  = {med[f'FBT k={k}'] / (k * med['FBT k=1']):.3f}  (goal <= 1.05)")
    print(f"document-causal / causal (k=1)  = {med['FBT k=1 doc'] / med['FBT k=1']:.3f}  (dense per-row mask)")
    runtime.shutdown()


if __name__ == "__main__":
    main()
