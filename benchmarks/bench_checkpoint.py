"""Checkpoint memory and time at DP=2: peak extra resident memory per rank during a save and a load,
over the full fp32 training state (12 bytes x parameters: master weights + two AdamW moments).

    python benchmarks/bench_checkpoint.py [--layers 12 --hidden 768 --vocab 32768] [--zero 1 3]

For each ZeRO stage: 2 gloo processes build the FBT model (>= 100M parameters by default), wrap it in the
DeepSpeed engine, take one training step (steady state: gradients, optimiser state), then save with
:class:`CheckpointManager` and load the checkpoint back into the engine (each rank reads its own
fragments). A sampler thread reads the resident memory of the rank's process (children included: the
writer may use helper processes) every 2 ms; "extra" is the peak minus the steady state just before.
Goal: <= 0.6 at DP=2 (each rank holds 1/DP of the state, plus a bounded buffer). Prints a JSON line per
stage and rank 0's summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class PeakRSS:
    """Peak resident memory (this process and its children) while the block runs."""

    def __init__(self, interval: float = 0.002):
        import psutil

        self.proc, self.interval = psutil.Process(), interval

    def rss(self) -> int:
        total = self.proc.memory_info().rss
        for child in self.proc.children(recursive=True):
            try:
                total += child.memory_info().rss
            except Exception:
                pass
        return total

    def __enter__(self):
        self.base = self.peak = self.rss()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def bench_rank(recipe_data: dict, out_dir: str) -> dict:
    import gc

    import torch
    import torch.distributed as dist

    from fbt_megatron.checkpoint import CheckpointManager
    from fbt_megatron.checkpoint.shards import StateFragments, param_specs
    from fbt_megatron.model.fbt_gpt import build_model
    from fbt_megatron.passes import PassSchedule
    from fbt_megatron.engine import Engine
    from fbt_megatron.recipe import load_recipe
    from fbt_megatron.data.synthetic import SyntheticLoader
    from fbt_megatron.parallel.runner import get_runner
    from fbt_megatron.train.train_step import FBTTrainStep
    from megatron.core import parallel_state as ps

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    recipe = load_recipe(data=recipe_data)
    model = build_model(recipe.model, recipe.feedback)
    n_params = sum(p.numel() for p in model.parameters())
    specs = param_specs(model)
    engine = Engine(model, recipe)
    zero = StateFragments(engine, specs)
    cfg = recipe.data.synthetic.model_copy(update={"seq_length": recipe.data.seq_length})
    loader = iter(SyntheticLoader(cfg, micro_batch_size=1, global_batch_size=2, dp_rank=ps.get_data_parallel_rank(),
                                  dp_size=2))
    step = FBTTrainStep(engine, get_runner(engine.model, engine), PassSchedule(recipe.schedule), recipe.seed,
                        torch.device("cpu"))
    step(0, [next(loader)], 1e-4)
    ckpt = CheckpointManager(Path(out_dir) / f"zero{recipe.parallel.zero_stage}", keep_last=1)
    state = {"optimizer_steps": 1, "train_state": {"step": 1}}

    gc.collect()
    dist.barrier()
    t0 = time.perf_counter()
    with PeakRSS() as save_mem:
        path = ckpt.save(1, zero, state)
    save_s = time.perf_counter() - t0
    gc.collect()
    dist.barrier()
    t0 = time.perf_counter()
    with PeakRSS() as load_mem:
        ckpt.load_training_state(path, zero)
    load_s = time.perf_counter() - t0
    full = 12 * n_params
    return {"zero": recipe.parallel.zero_stage, "rank": dist.get_rank(), "params": n_params,
            "full_state_gb": full / 1e9, "save_extra_ratio": (save_mem.peak - save_mem.base) / full,
            "load_extra_ratio": (load_mem.peak - load_mem.base) / full, "save_s": save_s, "load_s": load_s,
            "steady_rss_gb": save_mem.base / 1e9}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--zero", type=int, nargs="+", default=[1, 3])
    a = ap.parse_args(argv)
    os.environ["FBT_DEVICE"] = "cpu"

    from fbt_megatron.runtime import ParallelLayout
    from harness import run_distributed, tiny_recipe

    rows = []
    with tempfile.TemporaryDirectory(dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None) as tmp:
        for zero in a.zero:
            recipe = tiny_recipe(tmp, model={"num_layers": a.layers, "hidden_size": a.hidden,
                                             "num_attention_heads": a.heads, "vocab_size": a.vocab,
                                             "max_sequence_length": 64},
                                 data={"seq_length": 64, "synthetic": {"vocab_size": a.vocab}},
                                 batch={"global_batch_size": 2, "micro_batch_size": 1},
                                 parallel={"tensor": 1, "zero_stage": zero})
            for r in run_distributed(bench_rank, 2, recipe, tmp, layout=ParallelLayout(), timeout=3600):
                print(json.dumps(r), flush=True)
                rows.append(r)
    for zero in a.zero:
        rs = [r for r in rows if r["zero"] == zero]
        print(f"ZeRO-{zero} DP=2, {rs[0]['params'] / 1e6:.0f}M params ({rs[0]['full_state_gb']:.2f} GB fp32 state): "
              f"peak extra RSS / full state  save {max(r['save_extra_ratio'] for r in rs):.2f}  "
              f"load {max(r['load_extra_ratio'] for r in rs):.2f} (goal <= 0.6);  "
              f"save {max(r['save_s'] for r in rs):.1f} s  load {max(r['load_s'] for r in rs):.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
