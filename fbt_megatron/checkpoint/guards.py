"""What a checkpoint is checked for before it is loaded or published.

* Load: every file the manifest lists is read and checked against its recorded CRC-32 (what ``fbt ckpt
  verify`` checks), the files split over the ranks; a mismatch refuses the load, naming the file and
  the checkpoint before it.
* Save: the state to be written must be finite (fp32 master weights and both AdamW moments; the second
  moment not negative), and the disk must have room for it (the previous checkpoint's size, else the
  bytes of the state); an out-of-space error during the write is said in one sentence, its partial
  ``.tmp`` removed. A refused save keeps ``latest``.

Why: a corrupted checkpoint loaded without its checksums trained on and was saved again as a good one.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from fbt_megatron.checkpoint.discovery import LATEST, STEP_DIR, CheckpointError, file_crc32, step_dirs


class CheckpointCorrupted(CheckpointError):
    """A checkpoint file's bytes differ from the CRC-32 recorded when it was saved."""


class SaveRefused(CheckpointError):
    """A save was not started (or was undone): ``latest`` still names the previous checkpoint."""


# ---------------------------------------------------------------------- load
def previous_checkpoint(path: Path) -> Path | None:
    """The newest published checkpoint before ``path`` in its directory (None: none is kept)."""
    m = STEP_DIR.match(path.name)
    if m is None:
        return None
    older = [p for p in step_dirs(path.parent) if int(STEP_DIR.match(p.name).group(1)) < int(m.group(1))]
    return older[-1] if older else None


def where_to_go(path: Path, use: str) -> str:
    """What to do when checkpoint ``path`` cannot be loaded: the previous kept checkpoint and how to use
    it for ``use``: "resume" (fbt train resuming its run), "init_from", or "read" (generate, eval, tools)."""
    prev = previous_checkpoint(path)
    if prev is None:
        return f"no earlier checkpoint is kept in {path.parent}"
    if use == "init_from":
        return f"set init_from to the previous checkpoint {prev}"
    if use == "read":
        return f"give the previous checkpoint {prev} instead"
    return (f"resume from the previous checkpoint {prev.name} with "
            f"`echo {prev.name} > {path.parent / LATEST}` and the same fbt train command")


def _dist() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def verify_checksums(path: Path, *, use: str = "resume") -> None:
    """Check the CRC-32 of every file of checkpoint ``path`` against its manifest, each rank a share of
    the files (collective when a process group exists); raises :class:`CheckpointCorrupted` on every rank,
    saying what to do for ``use`` (:func:`where_to_go`)."""
    files = json.loads((path / "manifest.json").read_text())["files"]
    rank, world = _dist()
    mine = []
    for rel in sorted(files)[rank::world]:
        crc = file_crc32(path / rel)
        if crc != files[rel]["crc32"]:
            mine.append((rel, crc, files[rel]["crc32"]))
    found = [mine]
    if world > 1:
        found = [None] * world
        dist.all_gather_object(found, mine)
    bad = sorted(b for part in found for b in part)
    if bad:
        rel, crc, want = bad[0]
        more = f" (and {len(bad) - 1} other file(s))" if len(bad) > 1 else ""
        accept = ("; set checkpoint.verify_on_load=false only if you accept the damage"
                  if use != "read" and previous_checkpoint(path) is None else "")
        raise CheckpointCorrupted(
            f"checkpoint file {path / rel}{more} does not match the checksum recorded at save (CRC-32 {crc}, "
            f"expected {want}), so {path.name} is corrupted and was not loaded: {where_to_go(path, use)}{accept}")


# ---------------------------------------------------------------------- save
def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem holding ``path`` (its nearest existing ancestor)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def checkpoint_bytes(path: Path) -> int:
    """A published checkpoint's size, from its manifest."""
    return sum(f["bytes"] for f in json.loads((path / "manifest.json").read_text())["files"].values())


def _first_invalid(fragments) -> str | None:
    """The first tensor that no sound training state holds: non-finite values, or a negative AdamW second
    moment (a sum of squares; negative only when damaged, and the next step's square root of it is NaN)."""
    for frag in fragments:
        for which, t in frag.tensors.items():
            if not t.numel():
                continue
            if not bool(torch.isfinite(t).all()):
                return f"{which} of {frag.spec.name} holds non-finite values (NaN or inf)"
            if which == "exp_avg_sq" and bool((t < 0).any()):
                return f"{which} of {frag.spec.name} holds negative values (a second moment cannot be negative)"
    return None


def _written_bytes(fragments, dp_rank: int) -> int:
    return sum(frag.numel * t.element_size() for frag in fragments if not (frag.dp_replicated and dp_rank)
               for t in frag.tensors.values())


def check_before_save(root: Path, step: int, fragments, dp_rank: int, latest: Path | None) -> None:
    """Refuse a save (every rank alike, before anything is written) whose state is not finite or that the
    disk has no room for. Collective."""
    rank, world = _dist()
    mine = {"bad": _first_invalid(fragments), "bytes": _written_bytes(fragments, dp_rank),
            "free": free_bytes(root)}
    found = [mine]
    if world > 1:
        found = [None] * world
        dist.all_gather_object(found, mine)
    kept = f"{root / LATEST} still names {latest.name}" if latest is not None else "no checkpoint is published"
    bad = next((f["bad"] for f in found if f["bad"]), None)
    if bad is not None:
        raise SaveRefused(f"refusing to save step {step} to {root}: the {bad}, so training diverged or "
                          f"loaded a damaged state; {kept}, and a rerun resumes from it")
    needed = sum(f["bytes"] for f in found)
    if latest is not None and (latest / "manifest.json").exists():  # also counts state.json, rng, tokenizer
        needed = max(needed, checkpoint_bytes(latest))
    free = min(f["free"] for f in found)
    if free < needed:
        raise SaveRefused(out_of_space_message(root, step, needed, free, kept))


def out_of_space_message(root: Path, step: int, needed: int | None, free: int, kept: str) -> str:
    need = f"needs about {needed:,} bytes, {free:,} are free" if needed is not None else f"{free:,} bytes are free"
    return (f"no space left for checkpoint step {step} in {root} (it {need}); {kept}, and rerunning the same "
            f"command resumes from it once space is freed")


def is_out_of_space(exc: BaseException) -> bool:
    """ENOSPC/EDQUOT anywhere in an exception's chain, also inside PyTorch DCP's per-rank failures and
    torch.save's "unexpected pos" (its zip writer's way of reporting a full disk)."""
    seen = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)
        if "No space left on device" in text or "unexpected pos" in text:
            return True
        stack += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):  # {rank: (exception, traceback)}
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return False
