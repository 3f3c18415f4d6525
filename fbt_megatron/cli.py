"""The ``fbt`` command. Each sub-command lives with its concern and is imported lazily.

    fbt [--version] [-q | -v | --log-level LEVEL] [--log-all-ranks] COMMAND [args]   (fbt COMMAND --help)

Progress and diagnostics are logged to stderr (rank 0 only unless ``--log-all-ranks``); results meant
for pipes stay on stdout. ``FBT_LOG_LEVEL`` sets the default level (e.g. for jobs started by torchrun).
A user error (``fbt_megatron.errors``) is one sentence from rank 0 and exit status 2, also under
torchrun (``-m fbt_megatron.cli``); ``-v`` adds its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

COMMANDS = {
    "train": ("fbt_megatron.launch.train_cli", "Train from a recipe: fbt train RECIPE.yaml [key=value ...]"),
    "sft": ("fbt_megatron.launch.sft_cli", "Instruction tuning on chat data: fbt sft RECIPE.yaml (init_from, loss on assistant turns)"),
    "data": ("data_pipeline.cli", "Tokenizer, shards, embedded data: fbt data {tokenizer,prepare,embedded,...}"),
    "slurm": ("fbt_megatron.launch.cli", "SLURM jobs: fbt slurm submit RECIPE --nodes N --gpus-per-node G | status RUN_DIR | submit-prepare --array N ..."),
    "plan": ("fbt_megatron.launch.plan", "Size a run: fbt plan RECIPE --gpus N --gpu h100 (FLOPs, memory, time)"),
    "convert": ("fbt_megatron.hf.cli", "Hugging Face conversion: fbt convert {to-hf CHECKPOINT OUT,from-hf HF_DIR CKPT_DIR}"),
    "demo": ("fbt_megatron.demo", "Forward/backward of a tiny FBT model on CPU with 1..3 passes"),
    "ckpt": ("fbt_megatron.checkpoint.cli", "Checkpoints: fbt ckpt inspect|verify DIR (run dir or step dir)"),
    "generate": ("fbt_megatron.generate.cli", "Generate with latent feedback: fbt generate RUN_DIR --prompt TEXT"),
    "eval": ("fbt_megatron.eval.cli", "lm-eval tasks, standard vs feedback vs FUSED: fbt eval RUN_DIR --tasks T"),
}


def _parser() -> argparse.ArgumentParser:
    from fbt_megatron import __version__
    from fbt_megatron.logs import LEVELS

    ap = argparse.ArgumentParser(
        prog="fbt", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="full-bandwidth transformers (latent feedback) on Megatron-Core and DeepSpeed",
        epilog="commands:\n" + "\n".join(f"  {name:8s} {help_}" for name, (_, help_) in COMMANDS.items())
        + "\n\n`fbt COMMAND --help` describes each command.")
    ap.add_argument("--version", action="version", version=f"fbt_megatron {__version__}")
    level = ap.add_mutually_exclusive_group()
    level.add_argument("--log-level", type=str.upper, choices=LEVELS, default=None,
                       help="logging level (default INFO, or $FBT_LOG_LEVEL)")
    level.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    level.add_argument("-v", "--verbose", action="store_true", help="debug messages, with time and source")
    ap.add_argument("--log-all-ranks", action="store_true", help="every rank reports (prefixed), not rank 0 only")
    ap.add_argument("command", nargs="?", metavar="COMMAND", help=", ".join(COMMANDS))
    ap.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = _parser()
    try:
        a = ap.parse_args(argv)
    except SystemExit as e:  # --help, --version, a bad option: argparse has printed what it means
        return int(e.code or 0)
    if a.command is None:
        ap.print_help(sys.stderr)
        return 2
    if a.command not in COMMANDS:
        print(f"fbt: error: unknown command {a.command!r} (choose from {', '.join(COMMANDS)}; fbt --help)",
              file=sys.stderr)
        return 2
    from fbt_megatron import logs

    level = ("WARNING" if a.quiet else "DEBUG" if a.verbose else a.log_level
             or os.environ.get("FBT_LOG_LEVEL", "INFO"))
    try:
        logs.setup(level, all_ranks=a.log_all_ranks)
    except ValueError as e:  # a bad $FBT_LOG_LEVEL
        print(f"fbt: error: {e}", file=sys.stderr)
        return 2
    import importlib

    from fbt_megatron import errors

    try:
        module = importlib.import_module(COMMANDS[a.command][0])
        return int(module.main(a.args) or 0)
    except SystemExit as e:  # argparse inside a command (--help: 0, a usage error: 2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except Exception as e:  # a cause the user can fix: one sentence; anything else keeps its traceback
        if errors.user_error_message(e) is None:
            raise
        return errors.report(f"fbt {a.command}", e)


if __name__ == "__main__":
    sys.exit(main())
