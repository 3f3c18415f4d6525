"""``fbt train RECIPE.yaml [dotted.key=value ...] [--dry-run [--world-size N] [--gpu TYPE]]``

The recipe is resolved into its run plan (layout against the process count, data, tokenizer, the
checkpoint resumed; ``fbt_megatron/resolve``) before any process group starts; every problem is
reported at once (exit 2). Launch one process or several with torchrun; on CPU each takes the node's
cores shared among its ranks, or ``FBT_CPU_THREADS`` threads when set:

    fbt train recipes/tiny.yaml
    torchrun --nproc-per-node 2 -m fbt_megatron.cli train recipes/tiny.yaml parallel.zero_stage=2

A run resumes automatically from ``<run_dir>/checkpoints/latest``. To start over, give a new ``run_dir``
(``checkpoint.resume=false`` refuses a run_dir that holds checkpoints; ``checkpoint.resume: required``, in
``fbt convert from-hf``'s recipes, refuses one that holds none).

``--dry-run`` prints the resolved plan as YAML and writes nothing: ``recipe`` (every default filled; a
recipe ``fbt train`` reads back) and ``resolved`` (layout and DP size, micro-batches per step,
precision, tokenizer files, sources and weights, the checkpoint resumed and the rule adopted, the
pass mix, warnings). ``--world-size N``: for N processes (default $WORLD_SIZE, else 1). ``--gpu TYPE``
(h100, a100, ...): resolve for GPU nodes and add ``fbt plan``'s memory and time figures
(``--mfu``, default 0.40).
"""

from __future__ import annotations

import argparse
import os
import sys

from data_pipeline.argtypes import number, positive_int

USAGE = "usage: fbt train RECIPE.yaml [dotted.key=value ...] [--dry-run]   (fbt train --help)"


def _parser(prog: str) -> argparse.ArgumentParser:
    from fbt_megatron.launch.plan import DEVICES

    ap = argparse.ArgumentParser(prog=prog, add_help=False)
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--world-size", type=positive_int, default=None)
    ap.add_argument("--gpu", choices=list(DEVICES), default=None)
    ap.add_argument("--mfu", type=number(float, gt=0, le=1), default=0.40)
    return ap


def dry_run_text(plan, gpu: str | None, mfu: float) -> str:
    """The plan's YAML, plus ``fbt plan``'s memory and time figures (as comments) on ``gpu``."""
    text = plan.to_yaml()
    if gpu is None:
        return text
    from fbt_megatron.launch.plan import DEVICES, format_plan
    from fbt_megatron.launch.plan import plan as size

    sized = size(plan.recipe, plan.layout.world_size, gpu, mfu)
    return text + "# fbt plan:\n" + "".join(f"#   {line}\n" for line in
                                             format_plan(sized, plan.recipe, plan.layout.world_size, gpu, mfu,
                                                         DEVICES[gpu][0]).splitlines())


def main(argv: list[str] | None = None, task: str | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or "-h" in argv or "--help" in argv:
        print(__doc__.strip(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    prog = "fbt sft" if task == "sft" else "fbt train"
    a = _parser(prog).parse_intermixed_args(argv)
    from fbt_megatron import errors
    from fbt_megatron.recipe import load_recipe
    from fbt_megatron.resolve.plan import Environment
    from fbt_megatron.resolve.resolver import resolve_run

    world = a.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    env = Environment.nodes(gpu=True) if a.gpu else None
    try:
        recipe = load_recipe(a.recipe, a.overrides)
        plan = resolve_run(recipe, world, env, task=task)  # every problem at once, before any process group
    except errors.UserError as e:  # before any process group: every rank sees it, rank 0 says it
        return errors.report(prog, e)
    if a.dry_run:
        print(dry_run_text(plan, a.gpu, a.mfu), end="")
        return 0
    if a.world_size is not None or a.gpu is not None:
        print(f"{prog}: --world-size and --gpu describe a --dry-run (torchrun sets the processes)", file=sys.stderr)
        return 2

    import torch

    from fbt_megatron import runtime
    from fbt_megatron.engine import ensure_ds_accelerator

    ensure_ds_accelerator()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if not runtime.use_cuda():
        torch.set_num_threads(runtime.cpu_threads(local_world))
    runtime.init_distributed(timeout_s=plan.recipe.train.collective_timeout_s)
    from fbt_megatron.train.run import format_summary, train

    try:
        try:
            result = train(recipe, task=task)  # resolved again under the run directory's lock
        except errors.UserError as e:  # raised on every rank (a missing path, a locked run dir, ...)
            return errors.report(prog, e)
        if int(os.environ.get("RANK", "0")) == 0:  # the result: stdout (progress went to the log)
            print(format_summary(result), flush=True)
        # A preempted run saved its state and exits 0: torchrun must not restart it, the launcher
        # (slurm/ batch script) requeues. Other stops (non-finite losses) exit 3.
        return errors.DIVERGED_EXIT if result.stop_reason and not result.preempted else 0
    finally:
        runtime.shutdown()


if __name__ == "__main__":
    sys.exit(main())
