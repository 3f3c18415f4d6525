"""``fbt demo``: a tiny FBT model's forward/backward with 1..3 passes on CPU, plus the Jacobi check
against the token-by-token recurrence. A smoke test of an installation in a few seconds."""

from __future__ import annotations

import argparse
import os

from data_pipeline.argtypes import number


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="fbt demo", description=__doc__)
    ap.add_argument("--seq", type=number(int, ge=2), default=16, help="tokens per sequence (>= 2)")
    args = ap.parse_args(argv)
    os.environ.setdefault("FBT_DEVICE", "cpu")
    import torch

    from fbt_megatron import runtime
    from fbt_megatron.config import FeedbackConfig, ModelConfig
    from fbt_megatron.model.fbt_gpt import build_model
    from fbt_megatron.model.sequential import sequential_forward

    runtime.init_distributed()
    runtime.init_parallel_state(runtime.ParallelLayout())
    model = build_model(ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256,
                                    max_sequence_length=args.seq), FeedbackConfig())
    ids = torch.randint(0, 256, (2, args.seq))
    for k in (1, 2, 3):
        model.zero_grad()
        out = model(ids[:, :-1], labels=ids[:, 1:], num_passes=k, jitter_seed=k)
        loss = out.token_loss.mean()
        loss.backward()
        res = ", ".join(f"{r.item():.3f}" for r in out.pass_residuals) or "-"
        grad = model.feedback.value.weight.grad  # None after one pass: it feeds no state, so W_U is not used
        norm = 0.0 if grad is None else grad.norm().item()
        print(f"passes={k} loss={loss.item():.4f} |grad W_U|={norm:.3e} residuals=[{res}]")
    model.eval()
    ref = sequential_forward(model, ids)
    with torch.no_grad():
        full = model(ids, num_passes=args.seq)
    err = ((full.logits - ref.logits).norm() / ref.logits.norm()).item()
    print(f"{args.seq}-pass teacher forcing vs sequential recurrence: relative error {err:.2e}")
    runtime.shutdown()
    return 0 if err < 1e-5 else 1
