"""Helpers for the training tests: a tiny recipe and a picklable entry point for run_distributed."""

from __future__ import annotations

import copy
import os

TINY = {
    "name": "test",
    "seed": 1234,
    "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128,
              "max_sequence_length": 32},
    "feedback": {"jitter_std": 0.02},
    # Feedback from step 2 with a mix that makes multi-pass steps common in a short run.
    "schedule": {"feedback_start_step": 2, "mix": [0.2, 0.5, 0.3], "seed": 3},
    "parallel": {"tensor": 1, "zero_stage": 0},
    "batch": {"global_batch_size": 8, "micro_batch_size": 2},
    "optimizer": {"lr": 3e-3, "grad_clip": 1.0},
    "lr_schedule": {"kind": "cosine", "warmup_steps": 2},
    "data": {"seq_length": 32, "synthetic": {"vocab_size": 128}, "valid_sequences": 8},
    "train": {"steps": 6},
    "logging": {"log_every": 100, "tensorboard": False},
    "eval": {"every": 1000, "at_end": False},
    "checkpoint": {"every": 1000, "at_end": False, "keep_last": 2},
}


def tiny_recipe(run_dir: str, **sections) -> dict:
    """TINY with ``sections`` merged in (one level deep: ``parallel={"zero_stage": 2}``)."""
    data = copy.deepcopy(TINY)
    data["run_dir"] = str(run_dir)
    for key, value in sections.items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    return data


def train_fn(recipe_data: dict, inject_nonfinite=None, env: dict | None = None, fault: str | None = None) -> dict:
    """Run fbt_megatron.train.run.train in this (already distributed) process; return its summary.
    ``fault="<point>@<step>"`` kills the process (exit 17) at that point of a checkpoint save."""
    os.environ.update(env or {})
    from fbt_megatron.train.recipe import load_recipe
    from fbt_megatron.train.run import train

    recipe = load_recipe(data=recipe_data)
    return train(recipe, print_fn=lambda *a, **k: None, inject_nonfinite=set(inject_nonfinite or ()),
                 checkpoint_fault_hook=kill_at(fault) if fault else None)


def kill_at(fault: str):
    """A checkpoint fault hook that ends the process at ``<point>@<step>`` as a crash would."""
    want_point, want_step = fault.split("@")

    def hook(point: str, step: int) -> None:
        if point == want_point and step == int(want_step):
            os._exit(17)

    return hook


def main(argv=None) -> int:
    """``python -m fbt_megatron.train.testing RECIPE.yaml POINT@STEP``: ``fbt train`` with a save killed
    at POINT of step STEP (the crash tests run this as a child process; not a user command)."""
    import sys

    import yaml

    from fbt_megatron import runtime
    from fbt_megatron.train.engine import ensure_ds_accelerator

    recipe_path, fault = (argv if argv is not None else sys.argv[1:])[:2]
    ensure_ds_accelerator()
    runtime.init_distributed()
    try:
        train_fn(yaml.safe_load(open(recipe_path)), fault=fault)
    finally:
        runtime.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def losses(summary: dict) -> list[float]:
    return [h[2] for h in summary["history"]]
