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


IMPORT_DIR = "hf_import"  # beside checkpoints/ in a run fbt convert from-hf made: the source's tokenizer, provenance


def import_dir(checkpoint: Path) -> Path:
    """``<run>/hf_import`` for a checkpoint ``<run>/checkpoints/step_N``."""
    return checkpoint.parent.parent / IMPORT_DIR


def run_tokenizer(checkpoint: Path, recipe: dict | None) -> Path | None:
    """The tokenizer ``checkpoint``'s run was trained with, as a path the tokenizer loaders read (a
    ``tokenizer.json``'s folder or a ``tokenizer.model``): the copy the checkpoint carries (every save of a
    run on tokenized data keeps one), else an import's ``hf_import/`` copy, else, for checkpoints from
    before the copy, ``recipe``'s ``data.pipeline.tokenizer`` (a relative path tried from the working
    directory, then from the checkpoint's parent directories). None: none is known (synthetic data). One
    rule for export, generation, evaluation and the ``--tokenizer`` check; a recipe's path that is not found
    is :class:`CheckpointError`."""
    for where in (checkpoint, import_dir(checkpoint)):
        if (where / "tokenizer.json").is_file():  # a Hugging Face tokenizer: its folder, config files with it
            return where
        if (where / "tokenizer.model").is_file():
            return where / "tokenizer.model"
    data = (recipe or {}).get("data") or {}
    name = (data.get("pipeline") or {}).get("tokenizer") if data.get("source") == "pipeline" else None
    if not name:
        return None
    candidates = [Path(name)]
    if not Path(name).is_absolute():  # checkpoint = <repo>/runs/<name>/checkpoints/step_N
        candidates += [parent / name for parent in checkpoint.resolve().parents]
    found = next((c for c in candidates if c.exists()), None)
    if found is None:
        raise CheckpointError(f"the run's tokenizer {name} (its recipe's data.pipeline.tokenizer) was not found in "
                              f"{Path.cwd()} or the checkpoint's parent directories: pass --tokenizer PATH")
    return found


def check_given_tokenizer(checkpoint: Path, given: str | Path) -> None:
    """``--tokenizer GIVEN`` for ``checkpoint``: refused (:class:`UserError`) when the run's tokenizer is known
    from a copy (:func:`run_tokenizer`: the checkpoint's or an import's) and GIVEN is another one: another
    kind, or the same kind with other bytes; a wrong tokenizer would decode or export text the model never
    saw, without a word."""
    from data_pipeline.tokenizer import tokenizer_files, tokenizer_hash

    copy = run_tokenizer(checkpoint, None)
    if copy is None:
        return  # nothing to compare with (synthetic data, an older checkpoint)
    own = copy / "tokenizer.json" if copy.is_dir() else copy
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
