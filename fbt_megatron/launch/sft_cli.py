"""``fbt sft RECIPE.yaml [dotted.key=value ...]``: instruction tuning (``task: sft``; train/sft.py)

The recipe names chat datasets (``fbt data prepare --format chat``) in ``data.pipeline`` and the model
to start from in ``init_from`` (a run directory or checkpoint of ``fbt train`` or ``fbt convert
from-hf``; weights only). Everything else is ``fbt train``: layouts, torchrun, resume, SLURM, and
``--dry-run [--world-size N] [--gpu TYPE]`` (the resolved plan as YAML; nothing written).

    fbt sft recipes/tiny_sft.yaml
    fbt sft recipes/tiny_sft.yaml --dry-run
    torchrun --nproc-per-node 2 -m fbt_megatron.cli sft recipes/tiny_sft.yaml parallel.zero_stage=2
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or "-h" in argv or "--help" in argv:
        print(__doc__.strip(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    from fbt_megatron.launch.train_cli import main as train_main

    return train_main(argv, task="sft")


if __name__ == "__main__":
    sys.exit(main())
