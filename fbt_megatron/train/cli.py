"""``fbt train RECIPE.yaml [dotted.key=value ...]``

The recipe is validated (including the layout against the process count) before any process group
starts. Launch one process (2 CPU cores are used by torch's threads) or several with torchrun:

    fbt train recipes/tiny.yaml
    torchrun --nproc-per-node 2 -m fbt_megatron.cli train recipes/tiny.yaml parallel.zero_stage=2

A run resumes automatically from ``<run_dir>/checkpoints/latest`` (``checkpoint.resume=false`` to
start over).
"""

from __future__ import annotations

import os
import sys

USAGE = "usage: fbt train RECIPE.yaml [dotted.key=value ...]   (fbt train --help)"


def sft_recipe(recipe, task: str | None):
    """``fbt sft`` sets ``task: sft``; ``init_from`` supplies unset model/feedback sections (train/sft.py)."""
    from fbt_megatron.train.sft import check_sft, resolve_init_sections

    if task is not None and recipe.task != task:
        recipe.task = task
    recipe = resolve_init_sections(recipe)
    check_sft(recipe)
    return recipe


def main(argv: list[str] | None = None, task: str | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or "-h" in argv or "--help" in argv:
        print(__doc__.strip(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    from fbt_megatron.recipe import RecipeError, check_layout, load_recipe

    recipe_path, overrides = argv[0], argv[1:]
    try:
        recipe = load_recipe(recipe_path, overrides)
        recipe = sft_recipe(recipe, task)
        check_layout(recipe, int(os.environ.get("WORLD_SIZE", "1")))
    except (RecipeError, FileNotFoundError) as e:
        print(f"fbt train: {e}", file=sys.stderr)
        return 2

    import torch

    from fbt_megatron import runtime
    from fbt_megatron.engine import ensure_ds_accelerator

    ensure_ds_accelerator()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if not runtime.use_cuda():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    runtime.init_distributed(timeout_s=recipe.train.collective_timeout_s)
    from fbt_megatron.checkpoint import CheckpointError
    from fbt_megatron.data.fingerprint import DataChangedError
    from fbt_megatron.train.run import format_summary, train
    from fbt_megatron.train.run_lock import RunDirLocked

    try:
        try:
            result = train(recipe)
        except RunDirLocked as e:
            print(f"fbt train: {e}", file=sys.stderr)
            return 2
        except (CheckpointError, DataChangedError) as e:  # damaged, unsaveable or other-data checkpoints
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"fbt train: {e}", file=sys.stderr)
            return 2
        if int(os.environ.get("RANK", "0")) == 0:  # the result: stdout (progress went to the log)
            print(format_summary(result), flush=True)
        # A preempted run saved its state and exits 0: torchrun must not restart it, the launcher
        # (slurm/ batch script) requeues. Other stops (non-finite losses) exit 3.
        return 3 if result.stop_reason and not result.preempted else 0
    finally:
        runtime.shutdown()


if __name__ == "__main__":
    sys.exit(main())
