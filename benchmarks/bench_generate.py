"""Decode speed with latent feedback over standard decode, and prompt prefill time for K = 1, 2.

Same model, same run, measured side by side (rounds interleave the modes, in a rotating order; medians
reported):
- decode tokens/s with feedback / decode tokens/s standard (goal >= 0.98). Feedback decoding adds
  the fusion of the previous top state to each step (two D x D matmuls per token); standard decoding
  of the same FBT model is the plain transformer (no fusion computed).
- for reference, a plain GPT of the same size (fusion=off, no fusion layer at all).
- prefill seconds for K = 1, 2 (FUSED) passes and for the exact (token-by-token) prefill.

    .venv/bin/python benchmarks/bench_generate.py [--checkpoint runs/tiny] [--batch 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("FBT_DEVICE", "cpu")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from fbt_megatron import runtime  # noqa: E402


def build(fusion: str, args):
    from fbt_megatron.config import FeedbackConfig, ModelConfig
    from fbt_megatron.generate.model import build_inference_model

    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      vocab_size=4096, max_sequence_length=args.prompt + args.tokens + 1)
    return build_inference_model(cfg, FeedbackConfig(fusion=fusion))


def decode_seconds(decoder, prompts, tokens: int) -> float:
    session = decoder.session(prompts, tokens)
    logits = session.prefill()
    t0 = time.perf_counter()
    for _ in range(tokens):
        logits = session.step(logits.argmax(-1))
    return time.perf_counter() - t0


def prefill_seconds(decoder, prompts) -> float:
    session = decoder.session(prompts, 1)
    t0 = time.perf_counter()
    session.prefill()
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", help="a run or checkpoint (default: random weights, tiny recipe size)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--tokens", type=int, default=63)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    runtime.init_distributed()
    runtime.init_parallel_state(runtime.ParallelLayout())
    from fbt_megatron.generate.decoder import FeedbackDecoder

    if args.checkpoint:
        from fbt_megatron.generate.loading import load_for_inference

        model = load_for_inference(args.checkpoint, need_tokenizer=False).model
        args.prompt = min(args.prompt, model.model_config.max_sequence_length // 2)
        args.tokens = min(args.tokens, model.model_config.max_sequence_length - args.prompt - 1)
    else:
        model = build("glu", args)
    plain = build("off", args) if not args.checkpoint else None
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 4000, (args.batch, args.prompt), generator=g).tolist()
    decoders = {"feedback": FeedbackDecoder(model, "feedback", 2), "standard": FeedbackDecoder(model, "standard")}
    if plain is not None:
        decoders["plain GPT"] = FeedbackDecoder(plain, "standard")
    prefill = {f"K={k}": FeedbackDecoder(model, "feedback", k) for k in (1, 2, "exact")}

    with torch.no_grad():
        for d in decoders.values():  # warm-up
            decode_seconds(d, prompts, 4)
        decode = {name: [] for name in decoders}
        fill = {name: [] for name in prefill}
        names = list(decoders)
        for r in range(args.rounds):
            # rotate the order each round: whichever mode runs first after the prefill timings is slower
            for name in names[r % len(names):] + names[: r % len(names)]:
                decode[name].append(args.batch * args.tokens / decode_seconds(decoders[name], prompts, args.tokens))
            for name, d in prefill.items():
                fill[name].append(prefill_seconds(d, prompts))
    med = {k: statistics.median(v) for k, v in decode.items()}
    print(f"model: {args.layers} layers, hidden {args.hidden}; batch {args.batch}, prompt {args.prompt}, "
          f"{args.tokens} decoded tokens, {args.rounds} rounds (medians), {torch.get_num_threads()} threads")
    for name, v in med.items():
        print(f"decode {name:10s} {v:10.1f} tokens/s")
    print(f"decode feedback / standard = {med['feedback'] / med['standard']:.3f}   (goal >= 0.98)")
    if "plain GPT" in med:
        print(f"decode feedback / plain GPT (fusion=off) = {med['feedback'] / med['plain GPT']:.3f}")
    for name, v in fill.items():
        print(f"prefill {name:8s} {statistics.median(v) * 1e3:8.1f} ms   ({args.prompt} prompt tokens)")
    runtime.shutdown()


if __name__ == "__main__":
    main()
