"""What ``checkpoint.verify_on_load`` costs: a resume's load of the training state with and without the
CRC-32 check of every checkpoint file, on a tiny and a larger model (one process, CPU).

    python benchmarks/bench_verify_on_load.py [--sizes tiny larger] [--repeats 3]

Per size: build the model, wrap it in the DeepSpeed engine, take one step, save with
:class:`CheckpointManager`, then load the checkpoint back ``--repeats`` times with the check on and off
(alternating; the files are in the page cache after the save, as on a resume soon after it). Prints a JSON
line per size: checkpoint bytes, the best load time each way, the best time of the check alone (its
throughput) and its share of a load with the check.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"tiny": {}, "larger": {"num_layers": 8, "hidden_size": 512, "num_attention_heads": 8, "vocab_size": 32768}}


def bench_size(recipe_data: dict, out_dir: str, repeats: int) -> dict:
    import torch

    from fbt_megatron.checkpoint import CheckpointManager
    from fbt_megatron.checkpoint.guards import checkpoint_bytes, verify_checksums
    from fbt_megatron.checkpoint.shards import StateFragments, param_specs
    from fbt_megatron.data.synthetic import SyntheticLoader
    from fbt_megatron.engine import Engine
    from fbt_megatron.model.fbt_gpt import build_model
    from fbt_megatron.parallel.runner import get_runner
    from fbt_megatron.passes import PassSchedule
    from fbt_megatron.recipe import load_recipe
    from fbt_megatron.train.train_step import FBTTrainStep

    recipe = load_recipe(data=recipe_data)
    model = build_model(recipe.model, recipe.feedback)
    n_params = sum(p.numel() for p in model.parameters())
    specs = param_specs(model)
    engine = Engine(model, recipe)
    zero = StateFragments(engine, specs)
    cfg = recipe.data.synthetic.model_copy(update={"seq_length": recipe.data.seq_length})
    loader = iter(SyntheticLoader(cfg, micro_batch_size=1, global_batch_size=1, dp_rank=0, dp_size=1))
    step = FBTTrainStep(engine, get_runner(engine.model, engine), PassSchedule(recipe.schedule), recipe.seed,
                        torch.device("cpu"))
    step(0, [next(loader)], 1e-4)
    root = Path(out_dir) / f"{n_params}"
    path = CheckpointManager(root).save(1, zero, {"optimizer_steps": 1, "train_state": {"step": 1}})
    times = {True: [], False: [], "crc": []}
    for _ in range(repeats):
        for verify in (True, False):
            t0 = time.perf_counter()
            CheckpointManager(root, verify_on_load=verify).load_training_state(path, zero)
            times[verify].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        verify_checksums(path)  # the check alone
        times["crc"].append(time.perf_counter() - t0)
    on, off, crc = min(times[True]), min(times[False]), min(times["crc"])
    size = checkpoint_bytes(path)
    return {"params": n_params, "checkpoint_bytes": size, "load_s_verify_off": round(off, 4),
            "load_s_verify_on": round(on, 4), "crc_s": round(crc, 4), "crc_gb_per_s": round(size / crc / 1e9, 2),
            "crc_share_of_load": round(crc / (off + crc), 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    os.environ["FBT_DEVICE"] = "cpu"

    from fbt_megatron.runtime import ParallelLayout
    from harness import run_distributed, tiny_recipe

    with tempfile.TemporaryDirectory() as tmp:
        for size in a.sizes:
            model = SIZES[size]
            recipe = tiny_recipe(tmp, model={**model, "max_sequence_length": 32} if model else {},
                                 data={"seq_length": 32, "synthetic": {"vocab_size": model.get("vocab_size", 128)}},
                                 batch={"global_batch_size": 1, "micro_batch_size": 1})
            row = run_distributed(bench_size, 1, recipe, tmp, a.repeats, layout=ParallelLayout(), timeout=3600)[0]
            print(json.dumps({"size": size, **row}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
