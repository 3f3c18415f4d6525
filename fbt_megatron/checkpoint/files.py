"""The names and file checks every checkpoint module shares: the ``latest`` pointer, the ``step_N`` directories,
the CRC-32 of a file, and the error a checkpoint that cannot be used raises."""

from __future__ import annotations

import re
import zlib
from pathlib import Path

LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked (missing, truncated, wrong shapes, ...)."""


def step_dirs(root: Path) -> list[Path]:
    """Published checkpoints under ``root``, oldest step first."""
    found = [(int(m.group(1)), p) for p in root.glob("step_*") if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def file_crc32(path: Path, chunk: int = 1 << 22) -> str:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"
