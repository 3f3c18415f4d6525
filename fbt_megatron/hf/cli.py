"""`fbt convert`: Hugging Face conversion in both directions.

    fbt convert to-hf CHECKPOINT OUT_DIR [--dtype fp32|bf16|fp16] [--max-shard-size 2GiB] [--tokenizer X.model]
                                         [--standard]
    fbt convert from-hf HF_DIR CHECKPOINT_DIR [--fusion glu|additive|off]

CHECKPOINT is a run directory (its latest checkpoint), a checkpoints directory or one step directory,
saved in any parallel layout. Runs on one process (CPU is enough; memory stays about one layer plus
one output shard for to-hf).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMG]?I?B?)\s*", text.upper())
    if not m or m.group(2) not in UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; examples: 2GB, 500MB, 100000")
    size = int(float(m.group(1)) * UNITS[m.group(2)])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: a size must be > 0 bytes")
    return size


parse_size.bounds = {"gt": 0}  # (data_pipeline.argtypes: every numeric flag names its range)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="fbt convert", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="direction", required=True)
    to = sub.add_parser("to-hf", help="checkpoint -> Hugging Face directory (trust_remote_code)")
    to.add_argument("checkpoint")
    to.add_argument("out_dir")
    to.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    to.add_argument("--max-shard-size", type=parse_size, default=None,
                    help="largest safetensors shard, e.g. 2GB, 500MB (default: export.DEFAULT_SHARD_BYTES, 2 GiB)")
    to.add_argument("--tokenizer", default=None, help="a sentencepiece .model, a tokenizer.json or a folder of either; for a checkpoint without the run's copy (another one is refused)")
    to.add_argument("--standard", action="store_true",
                    help="a plain LlamaForCausalLM checkpoint (no remote code, no fusion): standard decoding; "
                         "Llama-class recipes only")
    frm = sub.add_parser("from-hf", help="Hugging Face directory (our export or a stock Llama) -> checkpoint")
    frm.add_argument("hf_dir")
    frm.add_argument("checkpoint_dir")
    frm.add_argument("--fusion", default=None, choices=["glu", "additive", "off"],
                     help="stock Llama only: the fusion to initialise (default glu; off = plain model)")
    a = ap.parse_args(argv)

    os.environ.setdefault("FBT_DEVICE", "cpu")
    from fbt_megatron import runtime
    from fbt_megatron.hf.mapping import ConversionError

    runtime.init_distributed()
    try:
        if a.direction == "to-hf":
            from fbt_megatron.hf.export import export_checkpoint

            shard = {} if a.max_shard_size is None else {"max_shard_bytes": a.max_shard_size}
            export_checkpoint(a.checkpoint, a.out_dir, dtype=a.dtype, tokenizer=a.tokenizer, standard=a.standard,
                              **shard)
        else:
            from fbt_megatron.hf.importer import import_hf

            import_hf(a.hf_dir, a.checkpoint_dir, fusion=a.fusion)
    except ConversionError as err:
        print(f"fbt convert: error: {err}", file=sys.stderr)
        return 2
    finally:
        runtime.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
