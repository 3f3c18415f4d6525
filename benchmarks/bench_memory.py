"""Peak activation memory of one FBT training micro-step (forward + backward) for k = 1, 2, 3 passes,
grad_mode all/last, activation recompute none/selective/full.

    python benchmarks/bench_memory.py [--layers 4 --hidden 256 --heads 8 --seq 256 --batch 8]

Each configuration runs in a fresh process. On GPU the figure is torch.cuda.max_memory_allocated()
during the step minus the memory allocated before it (weights and gradients). On CPU it is the growth of the process's peak resident set
(ru_maxrss) over what it held with the model built and its gradients allocated, with glibc told to mmap every allocation above 64 KiB
(MALLOC_MMAP_THRESHOLD_) so freed activations go back to the OS and the peak is the live peak, not
allocator caching. Prints one table: MiB per configuration and the ratio to k=1 without recompute.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def measure(args) -> float:
    import resource

    import torch

    from fbt_megatron import runtime
    from fbt_megatron.config import FeedbackConfig, ModelConfig
    from fbt_megatron.model.fbt_gpt import build_model

    runtime.init_distributed()
    runtime.init_parallel_state(runtime.ParallelLayout())
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      vocab_size=args.vocab, max_sequence_length=args.seq, recompute=args.recompute)
    model = build_model(cfg, FeedbackConfig(grad_mode=args.grad_mode, jitter_std=0.0)).train()
    dev = runtime.device()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(dev)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(dev)

    def step():
        model(ids, labels=labels, num_passes=args.k).token_loss.mean().backward()

    # Gradients allocated up front (backward accumulates into them), so the growth measured below is
    # the activations. No warm-up step: ru_maxrss is a lifetime peak, a warm-up would already hold it.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    if runtime.use_cuda():
        step()  # CUDA peak stats can be reset: warm up lazy buffers first
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        step()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    runtime.shutdown()
    return peak / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--one", nargs=3, metavar=("K", "GRAD_MODE", "RECOMPUTE"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        a.k, a.grad_mode, a.recompute = int(a.one[0]), a.one[1], a.one[2]
        print(json.dumps({"mib": measure(a)}))
        return 0

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    env.setdefault("FBT_DEVICE", "cpu")
    sizes = ["--layers", str(a.layers), "--hidden", str(a.hidden), "--heads", str(a.heads), "--vocab", str(a.vocab),
             "--seq", str(a.seq), "--batch", str(a.batch)]
    results = {}
    for recompute in ("none", "selective", "full"):
        for mode in ("all", "last"):
            for k in (1, 2, 3):
                out = subprocess.run([sys.executable, __file__, *sizes, "--one", str(k), mode, recompute],
                                     env=env, capture_output=True, text=True, check=True)
                results[(recompute, mode, k)] = json.loads(out.stdout.strip().splitlines()[-1])["mib"]
    base = results[("none", "all", 1)]
    print(f"peak activation memory of one micro-step, MiB (ratio to k=1 without recompute); layers={a.layers} "
          f"hidden={a.hidden} seq={a.seq} batch={a.batch} vocab={a.vocab}")
    print(f"{'recompute':10s} {'grad_mode':9s} " + " ".join(f"{'k=' + str(k):>16s}" for k in (1, 2, 3)))
    for recompute in ("none", "selective", "full"):
        for mode in ("all", "last"):
            cells = " ".join(f"{results[(recompute, mode, k)]:8.1f} ({results[(recompute, mode, k)] / base:4.2f})"
                             for k in (1, 2, 3))
            print(f"{recompute:10s} {mode:9s} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
