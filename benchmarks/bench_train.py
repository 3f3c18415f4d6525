"""Training-step throughput of `fbt train`'s step (DeepSpeed engine + FBTTrainStep) against a plain
PyTorch loop on Hugging Face's LlamaForCausalLM of about the same size, on CPU, side by side.

    python benchmarks/bench_train.py [--sizes 1.8M,28M,100M] [--rounds 5] [--sessions 1]
                                     [--micro-batch 8] [--seq 128] [--accumulation 2] [--dp2-size 28M] [--skip-dp2]
                                     [--skip-passes] [--same-process] [--stages 0,1,2,3]
                                     [--fixed-malloc]

Prints three tables:
1. DP=1: for each model size and ZeRO stage 0/1/2/3, fbt tokens/s over the HF loop's tokens/s
   (goal >= 1.0: the engine costs nothing on top of the model);
2. DP=2 (2 processes): ZeRO-1/2/3 step time over ZeRO-0 step time (goal <= 1.10);
3. FBT 2- and 3-pass step time over k x the 1-pass step time (ZeRO-1, goal <= 1.0).
Defaults are the tiny recipe's batch (micro-batch 8 x 2 accumulation x 128 tokens = 2048 tokens per step).
Every variant of tables 1 and 3 runs in a process of its own, as a training run does (one model per
process), and all are timed on the same batches in interleaved rounds (one step of each variant per
round, in an order rotated each round, the others waiting) and the median is reported, so drifting
machine load hits every variant alike. In one shared process the variants' steps interfered through
the allocator: at 28M the HF loop's step left fbt's next step 26k page faults (0 with fbt alone),
while HF's had none (``--same-process`` keeps that placement, to compare). Even a process each is not
free of the allocator: which side's large tensors glibc maps fresh (and the kernel faults in page by page,
every step) depends on the order of its allocations and frees (at 1.8M the HF loop's, 14.5k-28.1k pages
a step, fbt's 0.1k-4.0k: ``bench_page_faults.py``); ``--fixed-malloc`` fixes glibc's thresholds in every variant's
process so that neither side pays them for allocations up to 32 MiB (once its heap has grown to the
step's peak). Both sides train fp32 with AdamW, clip at 1.0, the same micro-batches and accumulation and
the same torch thread count; the FBT model runs 1 pass unless stated (its fusion layer included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from importlib.metadata import version

os.environ.setdefault("FBT_DEVICE", "cpu")

SIZES = {  # name -> (layers, hidden, heads); vocab 4096 (the embedded tokenizer), seq from --seq
    "1.8M": (4, 128, 4),    # the tiny recipe's width and depth (1.3M with its tied GPT block)
    "28M": (8, 512, 8),     # the size of the first measurement
    "100M": (14, 768, 12),  # ~105M parameters (Llama-class block, untied 4096-token vocabulary)
}
VOCAB = 4096
FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}  # --fixed-malloc


def llama_ffn(hidden: int) -> int:
    """SwiGLU width ~8/3 h rounded to a multiple of 64 (as Llama rounds to 256 at scale)."""
    return int(round(8 * hidden / 3 / 64)) * 64


def recipe_for(size: str, zero: int, a):
    from fbt_megatron.recipe import load_recipe

    layers, hidden, heads = SIZES[size]
    gbs = a.micro_batch * a.accumulation
    return load_recipe(data={
        # Llama-class on both sides (SwiGLU at ~8/3 h, RMSNorm, no biases, untied): the same block as HF's.
        "model": {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads, "vocab_size": VOCAB,
                  "max_sequence_length": a.seq, "activation": "swiglu", "normalization": "RMSNorm",
                  "add_bias_linear": False, "tie_embeddings": False, "ffn_hidden_size": llama_ffn(hidden)},
        "parallel": {"zero_stage": zero}, "batch": {"global_batch_size": gbs * a.dp, "micro_batch_size": a.micro_batch},
        "data": {"seq_length": a.seq, "synthetic": {"vocab_size": VOCAB}},
        "schedule": {"feedback_start_step": 10**9}, "optimizer": {"lr": 1e-4, "grad_clip": 1.0}})


class FixedPasses:
    def __init__(self, k):
        self.k = k

    def num_passes(self, step):
        return self.k


def fbt_step_fn(recipe, passes=1):
    """`fbt train`'s step function for ``recipe`` (a fresh model and engine), as run.train builds it."""
    from fbt_megatron import runtime
    from fbt_megatron.model.fbt_gpt import build_model
    from fbt_megatron.engine import Engine
    from fbt_megatron.parallel.runner import get_runner
    from fbt_megatron.train.train_step import FBTTrainStep

    runtime.init_parallel_state(runtime.ParallelLayout(), seed=recipe.seed)
    engine = Engine(build_model(recipe.model, recipe.feedback), recipe)
    step = FBTTrainStep(engine, get_runner(engine.model, engine), FixedPasses(passes), recipe.seed, runtime.device())
    return lambda i, micro: step(i, micro, 1e-4), sum(p.numel() for p in engine.model.parameters())


def hf_step_fn(recipe):
    """The plain loop: LlamaForCausalLM with the same block (width, depth, SwiGLU width, RMSNorm, no
    biases, untied embeddings)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    m = recipe.model
    inter = m.ffn_size
    cfg = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=inter,
                      num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                      num_key_value_heads=m.num_attention_heads, max_position_embeddings=m.max_sequence_length,
                      tie_word_embeddings=m.tie_embeddings, attention_dropout=0.0, attention_bias=False,
                      mlp_bias=False, rms_norm_eps=m.norm_epsilon)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).train()
    o = recipe.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)

    def step(i, micro):
        n = sum(float(b["loss_mask"].sum()) for b in micro)
        for b in micro:
            mask = b["loss_mask"]
            logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
            tl = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), b["labels"].flatten(),
                                                   reduction="none").view_as(mask)
            ((tl * mask).sum() / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, sum(p.numel() for p in model.parameters())


def batches(recipe, dp_rank, dp_size, steps):
    from fbt_megatron.data.loaders import build_train_loader

    it = iter(build_train_loader(recipe, dp_rank, dp_size, 0))
    return [[next(it) for _ in range(recipe.accumulation_steps(dp_size))] for _ in range(steps)]


def interleaved(variants: dict, steps: list, rounds: int) -> dict:
    """Median seconds per step of each variant: warm-up, then ``rounds`` rounds of one step each, the
    order rotated every round (the same on every rank): a variant that always ran first, or always
    right after the heaviest one, would carry that position's cost in every round."""
    times, _ = interleaved_timed({name: timed(fn, steps) for name, fn in variants.items()}, rounds)
    return {name: statistics.median(ts) for name, ts in times.items()}


def timed(fn, steps):
    """``fn(i, micro)`` as ``(i, batch index) -> (wall seconds, CPU seconds of the process's threads)``."""
    def run(i, j):
        t0, c0 = time.perf_counter(), time.process_time()
        fn(i, steps[j % len(steps)])
        return time.perf_counter() - t0, time.process_time() - c0
    return run


def interleaved_timed(variants: dict, rounds: int) -> dict:
    """Wall and CPU seconds per step of each variant, one per round (see :func:`interleaved`)."""
    times, cpu = {name: [] for name in variants}, {name: [] for name in variants}
    for fn in variants.values():
        fn(0, 0)
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            wall, used = variants[name](r + 1, r + 1)
            times[name].append(wall)
            cpu[name].append(used)
    return times, cpu


def build_variant(spec, a):
    """``spec`` = (kind, size, ZeRO stage, passes) -> (step function, parameter count); kind "hf" or "fbt"."""
    kind, size, zero, passes = spec
    recipe = recipe_for(size, zero, a)
    fn, params = hf_step_fn(recipe) if kind == "hf" else fbt_step_fn(recipe, passes)
    return fn, params


def start_variant(spec, a_dict, threads, steps: int):
    """In a fresh (spawned) process: the process set up as a DP=1 run, then ``spec``'s step function,
    its parameter count and ``steps`` batches (:func:`build_variant`, :func:`batches`)."""
    import torch

    from fbt_megatron import runtime
    from fbt_megatron.engine import ensure_ds_accelerator

    ensure_ds_accelerator()
    torch.set_num_threads(threads)
    runtime.init_distributed()
    a = argparse.Namespace(**a_dict)
    fn, params = build_variant(spec, a)
    return fn, params, batches(recipe_for(spec[1], 0, a), 0, 1, steps)


def _variant_worker(conn, spec, a_dict, threads):
    """A variant in a process of its own: builds its step and the batches, then times one step per
    ``(i, batch index)`` it is sent, until it is sent None."""
    from fbt_megatron import runtime

    fn, params, steps = start_variant(spec, a_dict, threads, a_dict["rounds"] + 1)
    step = timed(fn, steps)
    conn.send(params)
    while (msg := conn.recv()) is not None:
        conn.send(step(*msg))
    runtime.shutdown()


class VariantProcess:
    """One variant's step in a spawned process; calling it runs one step there and returns its seconds."""

    def __init__(self, spec, a):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_variant_worker, args=(child, spec, vars(a), a.threads), daemon=True)
        self.proc.start()
        child.close()  # only the child holds its end: a child that dies is an EOF here at once
        self.params = self._recv()

    def _recv(self):
        if not self.conn.poll(3600):
            raise TimeoutError("a benchmark variant's process did not answer within an hour")
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(30)
            raise RuntimeError(f"a benchmark variant's process died (exit code {self.proc.exitcode}; its "
                               "traceback is above)") from None

    def __call__(self, i, j):
        self.conn.send((i, j))
        return self._recv()

    def close(self):
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):  # the child is gone already: its error is the one to report
            pass
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.terminate()


def measure(specs: dict, a) -> tuple[tuple[dict, dict], dict]:
    """Step seconds per round (wall, CPU) and parameter counts of ``specs`` (name -> (kind, size, zero, passes)): each
    in its own process, or all in this one with ``--same-process``."""
    if a.same_process:
        fns, params = {}, {}
        for name, spec in specs.items():
            fns[name], params[name] = build_variant(spec, a)
        steps = batches(recipe_for(next(iter(specs.values()))[1], 0, a), 0, 1, a.rounds + 1)
        return interleaved_timed({name: timed(fn, steps) for name, fn in fns.items()}, a.rounds), params
    procs = {}
    try:
        for name, spec in specs.items():
            procs[name] = VariantProcess(spec, a)
        return interleaved_timed(procs, a.rounds), {name: p.params for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.close()


def per_round_ratios(times: dict) -> dict:
    """Per variant, HF's step over the variant's in each round (the machine's drift between rounds cancels)."""
    return {name: [h / v for h, v in zip(times["hf"], ts)] for name, ts in times.items()}


def dp1_table(a):
    rows = {}
    for size in a.sizes:
        specs = {f"zero{zero}": ("fbt", size, zero, 1) for zero in a.stages}
        specs["hf"] = ("hf", size, 0, 1)
        times, cpu, by_session = {name: [] for name in specs}, {name: [] for name in specs}, []
        for _ in range(a.sessions):  # fresh processes each session: what one process's placement costs averages out
            (t, c), params = measure(specs, a)
            for name in specs:
                times[name] += t[name]
                cpu[name] += c[name]
            by_session.append({name: statistics.median(r) for name, r in per_round_ratios(t).items()})
        med = {name: statistics.median(ts) for name, ts in times.items()}
        med_cpu = {name: statistics.median(ts) for name, ts in cpu.items()}
        paired = {name: sorted(r) for name, r in per_round_ratios(times).items()}
        rows[size] = (params[f"zero{a.stages[0]}"], params["hf"], med, paired, med_cpu, by_session)
        print(f"  [{size}: fbt {params[f'zero{a.stages[0]}'] / 1e6:.1f}M params, HF {params['hf'] / 1e6:.1f}M; median step s "
              + " ".join(f"{k}={v:.3f}" for k, v in med.items()) + "]", flush=True)
    return rows


def dp2_worker(size, a_dict):
    import torch
    from megatron.core import parallel_state as ps

    a = argparse.Namespace(**a_dict)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    variants = {f"zero{z}": fbt_step_fn(recipe_for(size, z, a))[0] for z in (0, 1, 2, 3)}
    steps = batches(recipe_for(size, 0, a), ps.get_data_parallel_rank(), 2, a.rounds + 1)
    return interleaved(variants, steps, a.rounds)


def passes_table(a, size):
    (times, _), _ = measure({f"k={k}": ("fbt", size, 1, k) for k in (1, 2, 3)}, a)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1.8M,28M,100M")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sessions", type=int, default=1,
                    help="table 1: start every variant's process afresh this many times, --rounds rounds each "
                         "(one process's placement in memory moved a run's ratio by a few %%)")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--dp2-size", default="28M")
    ap.add_argument("--passes-size", default="1.8M")
    ap.add_argument("--skip-dp2", action="store_true")
    ap.add_argument("--skip-passes", action="store_true")
    ap.add_argument("--stages", default="0,1,2,3", help="table 1's ZeRO stages (e.g. 0 for the goal's pair alone)")
    ap.add_argument("--same-process", action="store_true",
                    help="tables 1 and 3: every variant in this process (the placement before 2026-12-02)")
    ap.add_argument("--fixed-malloc", action="store_true",
                    help="every variant's process starts with glibc's mmap threshold at 32 MiB and its trim "
                         "threshold at 1 TiB (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_): allocations up to 32 MiB "
                         "come from the heap and stay mapped when freed, so no side's step faults them in afresh "
                         "(a process each only)")
    a = ap.parse_args(argv)
    a.sizes = [s for s in a.sizes.split(",") if s]
    a.stages = [int(z) for z in a.stages.split(",") if z]
    if a.sessions < 1 or (a.sessions > 1 and a.same_process):
        ap.error(f"--sessions {a.sessions}: at least 1, and fresh processes need a process each (not --same-process)")
    if a.fixed_malloc and a.same_process:
        ap.error("--fixed-malloc sets glibc's thresholds for the processes it starts; --same-process starts none")
    if a.fixed_malloc:  # read by glibc when a process starts: the variants' (spawned) processes inherit them
        os.environ.update(FIXED_MALLOC)
    if not a.stages or any(z not in (0, 1, 2, 3) for z in a.stages):
        ap.error(f"--stages {a.stages}: ZeRO stages from 0, 1, 2, 3")
    for s in [*a.sizes, a.dp2_size, a.passes_size]:
        if s not in SIZES:
            ap.error(f"unknown size {s!r}; allowed: {sorted(SIZES)}")

    import torch

    from fbt_megatron import runtime
    from fbt_megatron.engine import ensure_ds_accelerator

    ensure_ds_accelerator()
    a.threads = os.cpu_count() or 1
    torch.set_num_threads(a.threads)
    print(f"threads={torch.get_num_threads()} micro_batch={a.micro_batch} seq={a.seq} accumulation={a.accumulation} "
          f"rounds={a.rounds} (tokens per step {a.micro_batch * a.seq * a.accumulation}); variants "
          + ("in this process" if a.same_process else "in a process each")
          + (" with " + " ".join(f"{k}={v}" for k, v in FIXED_MALLOC.items()) if a.fixed_malloc else ""), flush=True)
    print("versions: " + " ".join(f"{name} {version(name)}" for name in ("torch", "megatron-core", "deepspeed", "transformers")), flush=True)

    a.dp = 1
    runtime.init_distributed()
    rows = dp1_table(a) if a.sizes else {}
    passes = None if a.skip_passes else passes_table(a, a.passes_size)
    runtime.shutdown()
    dp2 = None
    if not a.skip_dp2:
        from fbt_megatron.runtime import ParallelLayout
        from harness import run_distributed

        a.dp = 2
        dp2 = run_distributed(dp2_worker, 2, a.dp2_size, vars(a), layout=ParallelLayout(), timeout=3600)[0]

    print("\n1. DP=1: fbt tokens/s / HF LlamaForCausalLM loop tokens/s (goal >= 1.0)")
    columns = [f"zero{z}" for z in a.stages]
    print(f"{'size':>6s} {'fbt params':>11s} {'HF params':>10s} "
          + " ".join(f"{c.replace('zero', 'ZeRO-'):>{max(7, len(c) + 1)}s}" for c in columns))
    for size, (p_fbt, p_hf, med, _, _, _) in rows.items():
        print(f"{size:>6s} {p_fbt / 1e6:10.1f}M {p_hf / 1e6:9.1f}M "
              + " ".join(f"{med['hf'] / med[c]:{max(7, len(c) + 1)}.3f}" for c in columns))
    print("   the same, per round (HF's step / fbt's in that round): median [lowest - highest]")
    for size, (_, _, _, paired, _, _) in rows.items():
        print(f"{size:>6s} " + "  ".join(f"{c.replace('zero', 'ZeRO-')} {statistics.median(paired[c]):.3f} "
                                         f"[{paired[c][0]:.2f}-{paired[c][-1]:.2f}]" for c in columns))
    print("   the same in CPU seconds (all threads of each process: time stolen by the VM's host left out, OpenMP's spin-waits counted): HF's / fbt's")
    for size, (_, _, _, _, cpu, _) in rows.items():
        print(f"{size:>6s} " + "  ".join(f"{c.replace('zero', 'ZeRO-')} {cpu['hf'] / cpu[c]:.3f}" for c in columns))
    if a.sessions > 1:
        print(f"   per round, each session's median ({a.sessions} sessions of {a.rounds} rounds, fresh processes each)")
        for size, (_, _, _, _, _, by_session) in rows.items():
            print(f"{size:>6s} " + "  ".join(f"{c.replace('zero', 'ZeRO-')} " + " ".join(f"{s[c]:.3f}" for s in by_session)
                                             for c in columns))
    if dp2 is not None:
        print(f"\n2. DP=2 (2 processes, {a.dp2_size}): step time / ZeRO-0 step time (goal <= 1.10)")
        print("  " + "  ".join(f"ZeRO-{z}: {dp2[f'zero{z}'] / dp2['zero0']:.3f}" for z in (1, 2, 3))
              + f"   (ZeRO-0 step {dp2['zero0']:.3f} s)")
    if passes is not None:
        print(f"\n3. FBT k-pass step / (k x 1-pass step), {a.passes_size}, ZeRO-1 (goal <= 1.0)")
        print("  " + "  ".join(f"k={k}: {passes[f'k={k}'] / (k * passes['k=1']):.3f}" for k in (2, 3))
              + f"   (1-pass step {passes['k=1']:.3f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
