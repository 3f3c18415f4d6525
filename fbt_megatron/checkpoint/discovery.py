"""Finding a run's checkpoints without loading them (no torch, no process group): the ``latest``
pointer, the step directories, a checkpoint's ``state.json``. The run plan (fbt_megatron/resolve) reads
them before launch; :mod:`.manager` writes and loads what they find.
"""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

from fbt_megatron.errors import UserError

LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used as asked (missing, truncated, wrong shapes, ...)."""


# ---------------------------------------------------------------------- discovery (no process group needed)
def resolve_checkpoint(path: str | Path) -> Path:
    """A run dir or its ``checkpoints/`` dir -> the checkpoint ``latest`` names; a step dir -> itself."""
    path = Path(path)
    if (path / "state.json").exists():
        return path
    for root in (path / "checkpoints", path):
        if (root / LATEST).exists():
            return follow_latest(root)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist: give a run directory or a checkpoint's step_N directory")
    raise CheckpointError(f"{path} has no published checkpoint: it is neither a checkpoint (no state.json) "
                          f"nor a run directory with a checkpoints/{LATEST} pointer")


def follow_latest(root: Path) -> Path:
    pointer = root / LATEST
    name = pointer.read_text().strip()
    path = root / name
    if (path / "state.json").exists():
        return path
    aside = root / f"{name}.old"  # a re-save of this step was interrupted between its two renames
    if (aside / "state.json").exists():
        return aside
    raise CheckpointError(f"{pointer} names {name!r}, but {path} is not a complete checkpoint "
                          f"(expected {path / 'state.json'})")


def read_checkpoint_state(path: str | Path) -> dict:
    """``state.json`` of a checkpoint (or of a run dir's latest): step, layout, data cursor, recipe."""
    path = resolve_checkpoint(path)
    return json.loads((path / "state.json").read_text())


def step_dirs(root: Path) -> list[Path]:
    """Published checkpoints under ``root``, oldest step first."""
    found = [(int(m.group(1)), p) for p in root.glob("step_*") if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def file_crc32(path: Path, chunk: int = 1 << 22) -> str:
    """The CRC-32 of a file, as the manifest records it."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def check_given_tokenizer(checkpoint: Path, given: str | Path) -> None:
    """``--tokenizer GIVEN`` for ``checkpoint``: refused (:class:`UserError`) when the run's tokenizer is known
    (the copy its checkpoints carry, as every save on tokenized data does, or an import's ``hf_import/``) and
    GIVEN is another one: another kind, or the same kind with other bytes; a wrong tokenizer would decode or
    export text the model never saw, without a word."""
    from data_pipeline.tokenizer import tokenizer_files, tokenizer_hash

    imported = checkpoint.parent.parent / "hf_import"  # fbt convert from-hf's copy (hf.export.IMPORT_DIR)
    own = next(((d / n) for d in (checkpoint, imported) for n in ("tokenizer.json", "tokenizer.model")
                if (d / n).is_file()), None)
    if own is None:
        return  # nothing to compare with (synthetic data, an older checkpoint)
    try:
        files = tokenizer_files(given)
    except (OSError, ValueError, UserError):
        return  # a missing or unreadable path is the loader's sentence to say
    kind = "tokenizer.json" if "tokenizer.json" in files else "tokenizer.model"
    digest = [tokenizer_hash(f) for f in (own, files[kind])]  # of the one file: its bytes
    if digest[0] != digest[1]:  # another kind of tokenizer has other bytes too
        what = (f"a {kind}, the run's is a {own.name}" if kind != own.name else
                f"its {kind} differs byte for byte: {digest[1]}, the run's {digest[0]}")
        raise UserError(f"--tokenizer {given} is not the tokenizer {checkpoint} was trained with ({what}): leave "
                        "--tokenizer out to use the run's own copy")
