"""Core attention alone on CPU, side by side in one run: Megatron's unfused DotProductAttention (what the
local layers ran before), SDPADotProductAttention (what they run now) with the dense document
mask, and optionally FlexAttention with a document block mask (``--flex``: compiled by inductor, which
needs a C++ compiler and minutes of compile time on the first call).

    python benchmarks/bench_attention.py [--batch 8 --seq 128 --heads 8 --dim 64 --docs 3 --rounds 7] [--flex]
                                         [--forward-only]

Forward + backward of one layer's core attention (``--forward-only``: forward, no autograd); medians over
interleaved rounds; printed as time and ratio to Megatron's unfused attention (lower is faster).
FlexAttention has no backward on CPU (torch 2.13: "FlexAttention does not support backward on CPU"), so
it cannot train there: ``--flex`` on CPU needs ``--forward-only``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("FBT_DEVICE", "cpu")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--docs", type=int, default=3, help="documents per row")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--flex", action="store_true")
    ap.add_argument("--forward-only", action="store_true")
    a = ap.parse_args()
    if a.flex and not a.forward_only:
        ap.error("FlexAttention has no backward on CPU (torch 2.13), so it cannot train here: add --forward-only "
                 "to compare the forwards")

    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from fbt_megatron import runtime
    from fbt_megatron.config import ModelConfig
    from fbt_megatron.model.attention import SDPADotProductAttention, document_causal_mask
    from fbt_megatron.model.fbt_gpt import transformer_config

    runtime.init_distributed()
    runtime.init_parallel_state(runtime.ParallelLayout())
    config = transformer_config(ModelConfig(num_layers=1, hidden_size=a.heads * a.dim, num_attention_heads=a.heads,
                                            max_sequence_length=a.seq))
    s, b, h, d = a.seq, a.batch, a.heads, a.dim
    reset = torch.zeros(s, b, dtype=torch.bool)
    for i in range(a.docs):
        reset[i * s // a.docs] = True
    mask = document_causal_mask(reset)
    q, k, v = (torch.randn(s, b, h, d) for _ in range(3))
    variants = {
        "megatron unfused": (DotProductAttention(config, 1, AttnMaskType.arbitrary, "self"), mask),
        "sdpa (dense mask)": (SDPADotProductAttention(config, 1, AttnMaskType.arbitrary, "self"), mask),
    }
    if a.flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = reset.long().cumsum(0).t()  # [B, S]

        def document_causal(bi, hi, qi, ki):
            return (qi >= ki) & (doc[bi, qi] == doc[bi, ki])

        block = create_block_mask(document_causal, b, None, s, s, device="cpu")
        compiled = torch.compile(flex_attention)

        class Flex(torch.nn.Module):
            def forward(self, q, k, v, _mask):
                out = compiled(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), block_mask=block)
                return out.permute(2, 0, 1, 3).reshape(s, b, -1)

        variants["flex (block mask)"] = (Flex(), None)

    def step(module, m):
        if a.forward_only:
            with torch.no_grad():
                t0 = time.perf_counter()
                module(q, k, v, m)
                return time.perf_counter() - t0
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        t0 = time.perf_counter()
        out = module(*inputs, m)
        out.sum().backward()
        return time.perf_counter() - t0

    for module, m in variants.values():  # warm-up (and compile)
        step(module, m)
    times = {name: [] for name in variants}
    for _ in range(a.rounds):
        for name, (module, m) in variants.items():
            times[name].append(step(module, m))
    base = statistics.median(times["megatron unfused"])
    print(f"core attention {'forward' if a.forward_only else 'fwd+bwd'}, B={b} S={s} heads={h} d={d}, {a.docs} documents per row, "
          f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}")
    for name, t in times.items():
        print(f"  {name:<20} {1e3 * statistics.median(t):8.2f} ms   ratio {statistics.median(t) / base:.3f}")
    runtime.shutdown()


if __name__ == "__main__":
    main()
