"""The ``fbt`` command. Each sub-command lives with its concern and is imported lazily."""

from __future__ import annotations

import sys

COMMANDS = {
    "train": ("fbt_megatron.train.cli", "Train from a recipe: fbt train RECIPE.yaml [key=value ...]"),
    "data": ("data_pipeline.cli", "Tokenizer, shards, embedded data: fbt data {tokenizer,prepare,embedded,...}"),
    "slurm": ("fbt_megatron.launch.cli", "SLURM jobs: fbt slurm submit RECIPE --nodes N --gpus-per-node G | status RUN_DIR"),
    "plan": ("fbt_megatron.launch.plan", "Size a run: fbt plan RECIPE --gpus N --gpu h100 (FLOPs, memory, time)"),
    "convert": ("fbt_megatron.hf.cli", "Hugging Face conversion: fbt convert {to-hf CHECKPOINT OUT,from-hf HF_DIR CKPT_DIR}"),
    "demo": ("fbt_megatron.demo", "Forward/backward of a tiny FBT model on CPU with 1..3 passes"),
    "ckpt": ("fbt_megatron.checkpoint.cli", "Checkpoints: fbt ckpt inspect|verify DIR (run dir or step dir)"),
    "generate": ("fbt_megatron.generate.cli", "Generate with latent feedback: fbt generate RUN_DIR --prompt TEXT"),
    "eval": ("fbt_megatron.eval.cli", "lm-eval tasks, standard vs feedback vs FUSED: fbt eval RUN_DIR --tasks T"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: fbt COMMAND [args]\n\ncommands:")
        for name, (_, help_) in COMMANDS.items():
            print(f"  {name:8s} {help_}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    import importlib

    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
