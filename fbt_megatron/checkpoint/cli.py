"""``fbt ckpt inspect DIR`` and ``fbt ckpt verify DIR`` (DIR: a run dir, its checkpoints/ dir or a step dir).

inspect: step, the layout it was saved with, data cursor, recipe, every tensor's global shape and how many
pieces hold it, files and bytes. Reads only metadata.

verify: reads every byte of every file and checks it against the size and CRC-32 recorded at save time;
checks that the stored pieces of every tensor tile it exactly (no gap, no overlap); builds the recipe's
model (TP=1, one process) and checks that the checkpoint holds every parameter's master weights and both
AdamW moments with the model's shapes. Exit status 0 when all is well, 1 with one line per problem.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def inspect(path: Path, show_recipe: bool = True) -> str:
    from fbt_megatron.checkpoint.manager import read_tensor_metadata

    state = json.loads((path / "state.json").read_text())
    manifest = json.loads((path / "manifest.json").read_text()) if (path / "manifest.json").exists() else {"files": {}}
    ts = state.get("train_state", {})
    lines = [f"checkpoint   {path}",
             f"step         {ts.get('step')} (optimizer steps {state.get('optimizer_steps')}, skipped "
             f"{ts.get('skipped_steps')})",
             f"saved with   {state.get('layout')} on {state.get('world_size')} processes, format "
             f"{state.get('format_version')}",
             f"data cursor  {json.dumps(state.get('data_cursor', {}).get('consumed_sequences'))} sequences consumed; "
             f"loader {json.dumps(state.get('data_cursor', {}).get('loader'))}",
             f"pass mix     {ts.get('pass_counts')}"]
    meta = read_tensor_metadata(path)
    total = sum(math.prod(shape) * _itemsize(dtype) for shape, dtype, _ in meta.values())
    lines.append(f"tensors      {len(meta)}, {_fmt_bytes(total)} (fp32 master weights + AdamW moments)")
    for key, (shape, dtype, chunks) in sorted(meta.items()):
        lines.append(f"  {key:70s} {str(list(shape)):18s} {str(dtype).replace('torch.', ''):8s} {len(chunks)} pieces")
    files = manifest["files"]
    lines.append(f"files        {len(files)}, {_fmt_bytes(sum(f['bytes'] for f in files.values()))}")
    if show_recipe:
        lines.append("recipe       " + json.dumps(state.get("recipe"), sort_keys=True))
    return "\n".join(lines)


def _itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def verify(path: Path, check_model: bool = True, progress: bool | None = None) -> list[str]:
    """Problems found (empty list: the checkpoint is sound). ``progress``: a bar over the bytes read
    (stderr; None = only on a terminal)."""
    from tqdm import tqdm

    from fbt_megatron.checkpoint.manager import file_crc32, read_tensor_metadata

    problems = []
    manifest_file = path / "manifest.json"
    if not manifest_file.exists():
        return [f"{manifest_file} is missing"]
    files = json.loads(manifest_file.read_text())["files"]
    bar = tqdm(total=sum(info["bytes"] for info in files.values()), unit="B", unit_scale=True,
               desc=f"verify {path.name}", disable=None if progress is None else not progress, file=sys.stderr)
    for rel, info in sorted(files.items()):
        f = path / rel
        if not f.exists():
            problems.append(f"{f}: missing (expected {info['bytes']} bytes)")
            continue
        size = f.stat().st_size
        if size != info["bytes"]:
            problems.append(f"{f}: {size} bytes, expected {info['bytes']}")
            continue
        crc = file_crc32(f)
        bar.update(size)
        if crc != info["crc32"]:
            problems.append(f"{f}: CRC-32 {crc}, expected {info['crc32']} (corrupted)")
    bar.close()
    if problems:
        return problems
    meta = read_tensor_metadata(path)
    for key, (shape, _, chunks) in meta.items():
        problems += _tiling_problems(key, shape, chunks)
    if check_model:
        problems += _model_problems(path, meta)
    return problems


def _tiling_problems(key, shape, chunks) -> list[str]:
    volume = sum(math.prod(s) for _, s in chunks)
    if volume != math.prod(shape):
        return [f"tensor {key}: stored pieces hold {volume} elements, the tensor has {math.prod(shape)}"]
    for i, (o1, s1) in enumerate(chunks):  # pieces per tensor are few (a handful per rank)
        for o2, s2 in chunks[i + 1:]:
            if all(a < c + d and c < a + b for a, b, c, d in zip(o1, s1, o2, s2)):
                return [f"tensor {key}: pieces at {list(o1)} and {list(o2)} overlap"]
    return []


def _model_problems(path: Path, meta: dict) -> list[str]:
    """Build the recipe's model at TP=1 in a world of one and compare keys and shapes."""
    from fbt_megatron import runtime
    from fbt_megatron.checkpoint.shards import param_specs, storage_key
    from fbt_megatron.engine.zero_state import STATE_NAMES
    from fbt_megatron.model.fbt_gpt import build_model
    from fbt_megatron.recipe import load_saved_recipe

    state = json.loads((path / "state.json").read_text())
    recipe = load_saved_recipe(state["recipe"])
    os.environ.setdefault("FBT_DEVICE", "cpu")
    runtime.init_distributed()
    try:
        runtime.init_parallel_state(runtime.ParallelLayout(), seed=recipe.seed)
        specs = param_specs(build_model(recipe.model, recipe.feedback))
    finally:
        runtime.shutdown()
    problems = []
    for spec in specs:
        for which in STATE_NAMES:
            key = storage_key(spec.key, which)
            if key not in meta:
                problems.append(f"tensor {key} (parameter {spec.name}) is missing")
            elif tuple(meta[key][0]) != tuple(spec.global_shape):
                problems.append(f"tensor {key}: shape {list(meta[key][0])}, the recipe's model has "
                                f"{list(spec.global_shape)}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fbt ckpt", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_inspect = sub.add_parser("inspect", help="step, layout, tensors, data cursor, recipe")
    p_inspect.add_argument("dir")
    p_inspect.add_argument("--no-recipe", action="store_true", help="leave the recipe out")
    p_verify = sub.add_parser("verify", help="read every byte: sizes, CRCs, tiling, shapes vs the recipe")
    p_verify.add_argument("dir")
    p_verify.add_argument("--no-model", action="store_true", help="skip building the recipe's model")
    a = ap.parse_args(argv)

    from fbt_megatron.checkpoint.manager import CheckpointError, resolve_checkpoint

    try:
        path = resolve_checkpoint(a.dir)
        if a.cmd == "inspect":
            print(inspect(path, show_recipe=not a.no_recipe))
            return 0
        problems = verify(path, check_model=not a.no_model)
    except (CheckpointError, FileNotFoundError) as e:
        print(f"fbt ckpt: {e}", file=sys.stderr)
        return 1
    for line in problems:
        print(line)
    print(f"{path}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
