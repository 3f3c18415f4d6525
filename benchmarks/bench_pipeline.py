"""Pipeline bubble and activation memory at PP=2, k = 1, 2, 3 passes, measured on gloo processes.

For each k, after a warm-up step, every stage times each of its ops over several steps and reports:
- measured bubble = 1 - (time computing in ops) / (step time): the step is timed from a barrier to
  the end of ``PipelineRunner.run`` (final tied-gradient and loss all-reduces included), time blocked
  in a receive counts as idle;
- theoretical bubble = the schedule's own order simulated with each stage's median op time per
  (forward/backward, pass) and free communication (stages are unbalanced: the first has the embedding
  and fusion, the last the LM head, on its loss pass only), and the ratio measured / theoretical (goal
  <= 1.1); the uniform closed form (P-1)(f+b) / (m (k f + n_b b) + (P-1)(f+b)) is printed alongside;
- where the idle time goes: seconds per step blocked in receives ("wait") and outside any op
  ("outside": the end-of-step tied-gradient and loss all-reduces, which the simulation leaves out);
- peak activation memory per stage: the most bytes held at once by tensors autograd saved for
  backward (counted once per storage, via saved-tensor hooks), the schedule's peak number of held
  stage-pass activations, and their ratio (MiB per held stage-pass).

Usage: python benchmarks/bench_pipeline.py [--search] | [--layers 4 --hidden 256 --seq 128 --micro-batch 2
       --micro-batches 8 --grad-mode all --steps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("FBT_DEVICE", "cpu")


class SavedActivations:
    """Bytes of tensors saved for backward that are alive now / at most (one count per storage)."""

    def __init__(self):
        self.alive: dict[int, list] = {}  # storage pointer -> [references, bytes]
        self.now = self.peak = 0

    def __enter__(self):
        import torch

        outer = self

        class Handle:
            def __init__(self, t):
                self.t, self.key = t, t.untyped_storage().data_ptr()
                entry = outer.alive.setdefault(self.key, [0, t.untyped_storage().nbytes()])
                if entry[0] == 0:
                    outer.now += entry[1]
                    outer.peak = max(outer.peak, outer.now)
                entry[0] += 1

            def __del__(self):
                entry = outer.alive[self.key]
                entry[0] -= 1
                if entry[0] == 0:
                    outer.now -= entry[1]
                    del outer.alive[self.key]

        self._hooks = torch.autograd.graph.saved_tensors_hooks(Handle, lambda h: h.t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def stage_measurements(args, k: int) -> dict:
    """On one rank of a PP=2 world: op timings, step times and saved-activation peak for k passes."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from fbt_megatron.config import FeedbackConfig, ModelConfig
    from fbt_megatron.model.fbt_gpt import build_model
    from fbt_megatron.parallel.pipeline_runner import PipelineRunner
    from fbt_megatron.parallel.schedule import FORWARD, build_schedule, grad_passes_for

    torch.set_num_threads(args.threads)
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      vocab_size=args.vocab, max_sequence_length=args.seq)
    model = build_model(cfg, FeedbackConfig(grad_mode=args.grad_mode))
    model.train()
    runner = PipelineRunner(model)
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=g),
                "labels": torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=g),
                "loss_mask": torch.ones(args.micro_batch, args.seq)} for _ in range(args.micro_batches)]
    scale = 1.0 / (args.micro_batches * args.micro_batch * args.seq)
    runner.run(batches, k, training=True, scale=scale)  # warm-up
    steps, forwards, backwards, peaks, per_class = [], [], [], [], {}
    for _ in range(args.steps):
        model.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        with SavedActivations() as saved:
            out = runner.run(batches, k, training=True, scale=scale, timings=True)
        step = time.perf_counter() - t0
        busy = sum(end - begin - waited for _, begin, end, waited in out.op_seconds)
        in_ops = sum(end - begin for _, begin, end, _ in out.op_seconds)
        steps.append((step, busy, in_ops - busy, step - in_ops))  # + receive waits, time outside any op
        forwards += [end - begin - w for op, begin, end, w in out.op_seconds if op.kind == FORWARD]
        backwards += [end - begin - w for op, begin, end, w in out.op_seconds if op.kind != FORWARD]
        for op, begin, end, w in out.op_seconds:
            per_class.setdefault((op.kind, op.pass_index), []).append(end - begin - w)
        peaks.append(saved.peak)
    schedule = build_schedule(2, args.micro_batches, k, grad_passes_for(k, args.grad_mode, True))
    stage = ps.get_pipeline_model_parallel_rank()
    return {"stage": stage, "step": statistics.median(s[0] for s in steps),
            "bubble": statistics.median(1 - s[1] / s[0] for s in steps),
            "recv_wait": statistics.median(s[2] for s in steps), "outside_ops": statistics.median(s[3] for s in steps),
            "forward": statistics.median(forwards), "backward": statistics.median(backwards),
            # per (kind, pass) medians: the last stage's loss pass (the LM head) costs more than the others
            "per_class": {key: statistics.median(v) for key, v in per_class.items()},
            "peak_bytes": max(peaks), "held_passes": schedule.peak_activations(stage)}


def main():
    from fbt_megatron.parallel.schedule import build_schedule, grad_passes_for, simulated_bubbles, theoretical_bubble
    from fbt_megatron.runtime import ParallelLayout
    from harness import run_distributed

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--grad-mode", choices=["all", "last"], default="all")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per stage process")
    ap.add_argument("--passes", default="1,2,3")
    ap.add_argument("--search", action="store_true",
                    help="only time the schedule search (build_schedule, every rank runs it once per k)")
    args = ap.parse_args()
    if args.search:
        import time

        print(f"{'P':>2} {'m':>3} {'k':>2} {'grad':>4} {'search s':>8} {'bubble':>7}")
        for stages, m, k, mode in ((8, 32, 3, "all"), (8, 32, 3, "last"), (4, 64, 3, "all"), (4, 64, 3, "last"),
                                   (8, 31, 3, "all"), (4, 63, 3, "all")):
            t0 = time.perf_counter()
            s = build_schedule(stages, m, k, grad_passes_for(k, mode, True))
            print(f"{stages:>2} {m:>3} {k:>2} {mode:>4} {time.perf_counter() - t0:>8.2f} "
                  f"{max(s.bubble(i) for i in range(stages)):>7.3f}")
        return

    print(f"PP=2, {args.layers} layers, hidden {args.hidden}, seq {args.seq}, micro-batch {args.micro_batch}, "
          f"m={args.micro_batches} micro-batches, grad_mode={args.grad_mode}, {args.steps} timed steps "
          f"(medians)")
    print(f"{'k':>2} {'stage':>5} {'step s':>7} {'F ms':>6} {'B ms':>6} {'bubble':>7} {'theory':>7} "
          f"{'ratio':>6} {'uniform':>7} {'wait s':>6} {'outside s':>9} {'peak act MiB':>12} {'held passes':>11} "
          f"{'MiB/pass':>8}")
    for k in (int(x) for x in args.passes.split(",")):
        per_stage = run_distributed(stage_measurements, 2, args, k, layout=ParallelLayout(pipeline=2))
        schedule = build_schedule(2, args.micro_batches, k, grad_passes_for(k, args.grad_mode, True))
        theory = simulated_bubbles(schedule, [lambda op, c=r["per_class"]: c[(op.kind, op.pass_index)]
                                              for r in per_stage])
        uniform = theoretical_bubble(2, args.micro_batches, k, args.grad_mode)
        for r, th in zip(per_stage, theory):
            mib = r["peak_bytes"] / 2**20
            print(f"{k:>2} {r['stage']:>5} {r['step']:>7.2f} {1e3 * r['forward']:>6.1f} {1e3 * r['backward']:>6.1f} "
                  f"{r['bubble']:>7.3f} {th:>7.3f} {r['bubble'] / th:>6.2f} {uniform:>7.3f} "
                  f"{r['recv_wait']:>6.3f} {r['outside_ops']:>9.3f} {mib:>12.1f} {r['held_passes']:>11} {mib / r['held_passes']:>8.1f}")


if __name__ == "__main__":
    main()
