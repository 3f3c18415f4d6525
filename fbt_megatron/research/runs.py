"""Training runs for the experiments: ``fbt train`` in a subprocess, and loading what it saved."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def train_run(recipe: str, run_dir: Path, overrides: list[str], log_file: Path | None = None) -> dict:
    """``fbt train RECIPE run_dir=... OVERRIDES`` from scratch in a fresh process; returns summary.json."""
    run_dir = Path(run_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "fbt_megatron.cli", "train", str(ROOT / recipe), f"run_dir={run_dir}", *overrides]
    env = dict(os.environ, FBT_DEVICE=os.environ.get("FBT_DEVICE", "cpu"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with open(log_file or run_dir / "train.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {rc}; see {log_file or run_dir / 'train.log'}")
    return json.loads((run_dir / "summary.json").read_text())


def load_trained_model(run_dir_or_checkpoint):
    """(model, recipe, checkpoint dir) from a run's latest checkpoint (or a step dir), saved in any
    layout, as a TP=1 eval-mode model (inside a world-of-one process group)."""
    from fbt_megatron import runtime
    from fbt_megatron.checkpoint import load_model_weights, read_checkpoint_state, resolve_checkpoint
    from fbt_megatron.model.fbt_gpt import build_model
    from fbt_megatron.train.recipe import load_recipe

    latest = resolve_checkpoint(run_dir_or_checkpoint)
    recipe = load_recipe(data=read_checkpoint_state(latest)["recipe"])
    recipe.parallel.tensor = 1
    runtime.init_parallel_state(runtime.ParallelLayout(), seed=recipe.seed)
    model = build_model(recipe.model, recipe.feedback)
    load_model_weights(latest, model)
    return model.eval(), recipe, latest
