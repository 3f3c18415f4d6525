"""Page faults per training step of `fbt train`'s step and of the HF Llama loop (`bench_train.py`'s two
sides), each in fresh processes, one after the other, on CPU.

    python benchmarks/bench_page_faults.py [--size 1.8M] [--stage 1] [--processes 5] [--warmup 5] [--steps 5]
                                           [--fixed-malloc]

For each of ``--processes`` rounds, a fresh process of each side builds its model, runs ``--warmup`` steps,
then counts the minor page faults (``getrusage``'s ``ru_minflt``) and the wall time of each of the next
``--steps`` steps; it prints each process's mean faults and seconds per step. A fault is the kernel
mapping in (and zeroing) a page that the allocator took from the OS afresh: memory glibc gave back after
the previous step and the step asked for again. ``--fixed-malloc`` sets glibc's thresholds as
``bench_train.py --fixed-malloc`` does (then both fault little once warm: 0-1.5k pages a 1.8M step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys


import bench_train  # (this folder's benchmark: the two sides, their recipe and batches)


def _count(conn, kind, a_dict, threads):
    import resource
    import time

    from fbt_megatron import runtime

    a = argparse.Namespace(**a_dict)
    fn, _, steps = bench_train.start_variant((kind, a.size, a.stage, 1), a_dict, threads, a.warmup + a.steps)
    for i in range(a.warmup):
        fn(i, steps[i])
    faults, seconds = [], []
    for i in range(a.warmup, a.warmup + a.steps):
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        fn(i, steps[i])
        seconds.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    runtime.shutdown()
    conn.send((statistics.mean(faults), statistics.mean(seconds)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1.8M", choices=sorted(bench_train.SIZES))
    ap.add_argument("--stage", type=int, default=1, choices=(0, 1, 2, 3), help="fbt's ZeRO stage")
    ap.add_argument("--processes", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--fixed-malloc", action="store_true")
    a = ap.parse_args(argv)
    if min(a.processes, a.warmup, a.steps) < 1:
        ap.error("--processes, --warmup and --steps must be at least 1")
    a.dp = 1
    if a.fixed_malloc:
        os.environ.update(bench_train.FIXED_MALLOC)  # inherited by the spawned processes
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    threads = os.cpu_count() or 1  # as bench_train.py's table 1
    print(f"{a.size} ZeRO-{a.stage} (fbt), micro-batch {a.micro_batch} x {a.seq} x {a.accumulation}, threads {threads}, "
          f"steps {a.warmup + 1}-{a.warmup + a.steps} of fresh processes, "
          f"{'glibc thresholds fixed' if a.fixed_malloc else 'default glibc'}")
    print("process  fbt faults/step  fbt s/step  HF faults/step  HF s/step")
    for p in range(a.processes):
        row = []
        for kind in ("fbt", "hf"):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_count, args=(child, kind, vars(a), threads))
            proc.start()
            child.close()
            try:
                row.append(parent.recv())
            except EOFError:
                proc.join()
                print(f"the {kind} process exited with {proc.exitcode} before reporting", file=sys.stderr)
                return 1
            proc.join()
        (ff, fs), (hf, hs) = row
        print(f"{p:7d}  {ff:15.0f}  {fs:10.3f}  {hf:14.0f}  {hs:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
