"""Check `fbt plan` against measured runs on this CPU: step time of the tiny recipe, and peak memory of
two configurations.

    python benchmarks/bench_plan.py [--steps 24] [--mfu 0.5]

1. Step time: the tiny recipe (synthetic tokens: the same model and batch shapes as its embedded data)
   trains single-pass steps, then 3-pass steps (mix [0, 0, 1]); the plan predicts each at the stated
   MFU of this machine's measured fp32 matmul rate (`fbt plan --gpu cpu`). Printed: predicted and
   measured seconds per step, the MFU that would have matched, and the 3-pass/1-pass time ratio
   (the plan's pass model says 3.0 with grad_mode all), which does not depend on the MFU. One torch
   thread by default (FBT_BENCH_THREADS): on a shared, oversubscribed machine 2 spinning OpenMP threads
   measure the contention, not the model.
2. Memory: two configurations, each trained for 3 steps in a fresh process; the peak resident memory
   (VmHWM) minus the resident memory just before the model is built is compared with the plan's
   weights + gradients + optimiser + activations + logits (fp32, no reserve).
Prints one JSON line per check.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

QUIET = ["eval.every=100000", "eval.at_end=false", "checkpoint.every=100000", "checkpoint.at_end=false",
         "logging.tensorboard=false", "logging.log_every=100000", "checkpoint.resume=false"]
MEMORY_CONFIGS = {
    "A: 8x512, ZeRO-0, micro-batch 4 x 256 tok, 3 passes (grad all)": [
        "model.num_layers=8", "model.hidden_size=512", "model.num_attention_heads=8", "model.vocab_size=8192",
        "model.max_sequence_length=256", "data.seq_length=256", "batch.global_batch_size=4",
        "batch.micro_batch_size=4", "parallel.zero_stage=0", "schedule.feedback_start_step=0",
        "schedule.mix=[0,0,1]"],
    "B: 8x512, ZeRO-1, micro-batch 8 x 256 tok, 1 pass": [
        "model.num_layers=8", "model.hidden_size=512", "model.num_attention_heads=8", "model.vocab_size=8192",
        "model.max_sequence_length=256", "data.seq_length=256", "batch.global_batch_size=8",
        "batch.micro_batch_size=8", "parallel.zero_stage=1", "schedule.feedback_start_step=100000"],
}


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


THREADS = int(os.environ.get("FBT_BENCH_THREADS", "1"))


def _train(overrides: list[str], run_dir: str):
    os.environ.setdefault("FBT_DEVICE", "cpu")
    import torch

    from fbt_megatron import runtime
    from fbt_megatron.engine import ensure_ds_accelerator
    from fbt_megatron.recipe import load_recipe
    from fbt_megatron.train import run as _run  # noqa: F401  (imports before the baseline)

    ensure_ds_accelerator()
    torch.set_num_threads(THREADS)  # the same count for the matmul peak and the run
    recipe = load_recipe(ROOT / "recipes" / "tiny.yaml", ["data.source=synthetic", *QUIET, *overrides,
                                                          f"run_dir={run_dir}"])
    runtime.init_distributed()
    import deepspeed  # noqa: F401
    import megatron.core  # noqa: F401

    baseline = _rss("VmRSS")
    summary = _run.train(recipe, print_fn=lambda *a, **k: None).summary()
    peak = _rss("VmHWM")
    runtime.shutdown()
    return recipe, summary, baseline, peak


def memory_one(name: str) -> dict:
    from fbt_megatron.launch.plan import GB, plan

    with tempfile.TemporaryDirectory() as d:
        recipe, _, baseline, peak = _train([*MEMORY_CONFIGS[name], "train.steps=3"], d)
    pl = plan(recipe, 1, "cpu", 0.5, peak=1.0, fp32=True, reserve=0.0)
    m = pl.memory
    return {"check": "memory", "config": name, "params": pl.params,
            "predicted_gb": round(m.total / GB, 3), "measured_peak_minus_baseline_gb": round((peak - baseline) / GB, 3),
            "ratio_measured_over_predicted": round((peak - baseline) / m.total, 3),
            "predicted_parts_gb": {k: round(v / GB, 3) for k, v in
                                   (("weights", m.weights), ("grads", m.grads), ("optimizer", m.optimizer),
                                    ("activations", m.activations), ("logits", m.logits))}}


def step_time(steps: int, mfu: float) -> dict:
    from fbt_megatron.launch.plan import measure_cpu_peak, plan

    half = steps // 2
    with tempfile.TemporaryDirectory() as d:
        recipe, summary, _, _ = _train([f"train.steps={steps}", f"schedule.feedback_start_step={half}",
                                        "schedule.mix=[0,0,1]"], d)
    import torch

    torch.set_num_threads(THREADS)
    peak = measure_cpu_peak()
    pl = plan(recipe, 1, "cpu", mfu, peak=peak, fp32=True)
    secs, passes = summary["step_seconds"], [h[1] for h in summary["history"]]
    warm = 3  # the first steps include allocation and DeepSpeed's lazy setup
    one = [t for i, (t, k) in enumerate(zip(secs, passes)) if k == 1 and i >= warm]
    three = [t for i, (t, k) in enumerate(zip(secs, passes)) if k == 3 and i >= half + 1]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    predicted_1 = pl.phases[0]["step_seconds"]
    predicted_3 = predicted_1 * 3  # grad_mode all: 3 x (forward + backward)
    return {"check": "step_time", "recipe": "tiny (synthetic tokens)", "cpu_matmul_peak_gflops": round(peak / 1e9, 1),
            "mfu_assumed": mfu, "predicted_s_1pass": round(predicted_1, 4), "measured_s_1pass": round(med(one), 4),
            "predicted_s_3pass": round(predicted_3, 4), "measured_s_3pass": round(med(three), 4),
            "mfu_that_matches_1pass": round(mfu * predicted_1 / med(one), 3),
            "ratio_3pass_over_1pass_measured": round(med(three) / med(one), 3), "ratio_predicted": 3.0,
            "threads": THREADS, "load_average": round(os.getloadavg()[0], 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--mfu", type=float, default=0.5)
    ap.add_argument("--one-memory", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one_memory:
        print(json.dumps(memory_one(a.one_memory)))
        return 0
    print(json.dumps(step_time(a.steps, a.mfu)), flush=True)
    for name in MEMORY_CONFIGS:  # a fresh process each: the peak is per process
        r = subprocess.run([sys.executable, __file__, "--one-memory", name], capture_output=True, text=True)
        line = [x for x in r.stdout.splitlines() if x.startswith("{")]
        print(line[-1] if line else json.dumps({"check": "memory", "config": name, "error": r.stderr[-2000:]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
