"""Bad inputs and faults around checkpoints, as a user meets them through `fbt train`: each case asserts the
one-sentence message, the exit code, and that nothing was lost (the run directory unchanged, or `latest`
kept and still sound).

Every case calls `fbt train`'s entry point (``fbt_megatron.launch.train_cli.main``) in one process, each call a
world of one; faults are injected by the test (a flipped byte, a replaced dataset, a patched free-space
probe or writer, a state damaged after loading)."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml

from tests.support.distributed import run_distributed
from tests.support.training import tiny_recipe

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------- helpers (in the worker process)
def _fbt_train(recipe: dict, where: Path) -> tuple[int, str]:
    """``fbt train RECIPE`` in this process: (exit code, stderr)."""
    from fbt_megatron.launch import train_cli as cli

    path = where / f"recipe_{len(list(where.glob('recipe_*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        rc = cli.main([str(path)])
    return rc, err.getvalue()


def _snapshot(run_dir: Path) -> dict:
    """Every file of a run directory with its content hash (the run lock, held only while a run lives, left out)."""
    return {str(p.relative_to(run_dir)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != "run.lock"}


def _flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _step_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "event" not in r]


def _latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def _sound(run_dir: Path) -> list[str]:
    from fbt_megatron.checkpoint.cli import verify
    from fbt_megatron.checkpoint.manager import resolve_checkpoint

    return verify(resolve_checkpoint(run_dir), check_model=False, progress=False)


def _alone() -> None:
    """From here on each `fbt train` call starts (and ends) a world of one of its own."""
    from fbt_megatron import runtime

    runtime.shutdown()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)


# ---------------------------------------------------------------------- checkpoint faults
def checkpoint_faults(base: str) -> dict:
    import fbt_megatron.checkpoint.guards as guards
    import fbt_megatron.checkpoint.manager as manager

    _alone()
    base = Path(base)
    run = base / "run"
    out = {}
    recipe = tiny_recipe(run, train={"steps": 4}, checkpoint={"every": 2, "keep_last": 3})
    out["train"] = _fbt_train(recipe, base)
    ckpts = run / "checkpoints"

    # 1. a flipped byte in a shard of the latest checkpoint: resume and init_from refuse, nothing is written
    shard = sorted((ckpts / "step_00000004" / "weights").glob("*.distcp"))[0]
    _flip_byte(shard)
    before = _snapshot(run)
    out["flipped"] = _fbt_train(dict(recipe, train={**recipe["train"], "steps": 6}), base)
    out["flipped_unchanged"] = _snapshot(run) == before
    out["shard"] = str(shard)
    other = base / "other"
    out["flipped_init_from"] = _fbt_train(tiny_recipe(other, init_from=str(ckpts / "step_00000004")), base)
    out["init_from_wrote"] = sorted(str(p.relative_to(other)) for p in other.rglob("*") if p.is_file()) \
        if other.exists() else []
    # the advice works: `latest` set back to step 2, the same command resumes there and trains 3..6 again;
    # metrics.jsonl then holds each step once
    (ckpts / "latest").write_text("step_00000002\n")
    out["recovered"] = _fbt_train(dict(recipe, train={**recipe["train"], "steps": 6}), base)
    out["recovered_steps"] = [r["step"] for r in _step_rows(run)]
    out["recovered_sound"] = _sound(run)

    longer = dict(recipe, train={**recipe["train"], "steps": 8})
    # 2. no room for the next checkpoint: refused before writing, `latest` kept
    real_free = guards.free_bytes
    guards.free_bytes = lambda path: 1000
    try:
        out["full_before"] = _fbt_train(longer, base)
    finally:
        guards.free_bytes = real_free
    out["full_before_latest"] = _latest(run)
    out["full_before_left"] = sorted(p.name for p in ckpts.iterdir())
    out["full_before_sound"] = _sound(run)

    # 3. the disk fills during the write: one sentence, the partial step_N.tmp removed, `latest` kept
    real_write = manager._write_pieces

    def fills_up(pieces, weights_dir):
        (Path(weights_dir) / "__0_0.distcp").write_bytes(b"\0" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    manager._write_pieces = fills_up
    try:
        out["full_during"] = _fbt_train(longer, base)
    finally:
        manager._write_pieces = real_write
    out["full_during_latest"] = _latest(run)
    out["full_during_left"] = sorted(p.name for p in ckpts.iterdir())
    out["full_during_sound"] = _sound(run)

    # 4. a damaged optimizer state (a negative second moment, as the flipped bytes gave when loaded without
    # checksums): the first step after the resume is applied and writes NaN into the embedding rows; the
    # next steps are skipped (NaN loss); the save of that state is refused and `latest` kept
    real_load = manager.CheckpointManager.load_training_state

    def damaged(self, path, zero):
        state = real_load(self, path, zero)
        for frag in zero.fragments():
            if "word_embeddings" in frag.spec.name:
                frag.tensors["exp_avg_sq"][:64] = -1.7e9
        return state

    manager.CheckpointManager.load_training_state = damaged
    try:
        out["nonfinite"] = _fbt_train(longer, base)
    finally:
        manager.CheckpointManager.load_training_state = real_load
    out["nonfinite_rows"] = [(r["step"], r["skipped"], r["loss"]) for r in _step_rows(run)]
    out["nonfinite_latest"] = _latest(run)
    out["nonfinite_sound"] = _sound(run)
    return out


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpt_faults")
    return run_distributed(checkpoint_faults, 1, str(base))[0]


def test_a_flipped_byte_refuses_resume_and_init_from_and_loses_nothing(faults):
    assert faults["train"][0] == 0
    rc, err = faults["flipped"]
    assert rc == 2 and err.count("\n") == 1, err  # one line, no traceback
    assert faults["shard"] in err and "does not match the checksum" in err
    assert "echo step_00000002 >" in err and "checkpoints/latest" in err, err
    assert faults["flipped_unchanged"]
    rc, err = faults["flipped_init_from"]
    assert rc == 2 and err.count("\n") == 1 and faults["shard"] in err, err
    assert "set init_from to the previous checkpoint" in err and err.rstrip().endswith("step_00000002"), err
    assert not any(p.startswith("checkpoints") or p == "metrics.jsonl" for p in faults["init_from_wrote"])


def test_following_the_advice_resumes_and_metrics_keep_one_row_per_step(faults):
    assert faults["recovered"][0] == 0, faults["recovered"]
    assert faults["recovered_steps"] == [1, 2, 3, 4, 5, 6]  # steps 3 and 4 trained twice, listed once
    assert faults["recovered_sound"] == []


def test_no_room_before_the_save_is_one_sentence_and_keeps_latest(faults):
    rc, err = faults["full_before"]
    assert rc == 2 and err.count("\n") == 1, err
    assert "no space left for checkpoint step 8 in" in err and "1,000 are free" in err and "needs about" in err
    assert "latest still names step_00000006" in err and "resumes from it" in err
    assert faults["full_before_latest"] == "step_00000006"
    assert not any(n.endswith(".tmp") for n in faults["full_before_left"]) and "step_00000008" not in \
        faults["full_before_left"]
    assert faults["full_before_sound"] == []


def test_a_disk_that_fills_during_the_save_is_one_sentence_and_leaves_no_tmp(faults):
    rc, err = faults["full_during"]
    assert rc == 2 and err.count("\n") == 1, err
    assert "no space left for checkpoint step 8 in" in err and "latest still names step_00000006" in err
    assert faults["full_during_latest"] == "step_00000006"
    assert faults["full_during_left"] == ["latest", "step_00000002", "step_00000004", "step_00000006"]
    assert faults["full_during_sound"] == []


def test_a_damaged_state_is_never_published(faults):
    rc, err = faults["nonfinite"]
    assert rc == 2 and err.count("\n") == 1, err
    assert "refusing to save step 8" in err and "word_embeddings" in err and "non-finite" in err, err
    assert "latest still names step_00000006" in err
    # which step wrote the NaN: the first after the resume, applied (finite loss); the next is skipped
    rows = dict((s, (skipped, loss)) for s, skipped, loss in faults["nonfinite_rows"])
    assert rows[7][0] is False and rows[7][1] == rows[7][1]  # applied, finite loss
    assert rows[8][0] is True
    assert faults["nonfinite_latest"] == "step_00000006" and faults["nonfinite_sound"] == []


# ---------------------------------------------------------------------- data replaced under a run
def _prepare(raw: Path, out: Path, tok: str, docs: int, seed: int) -> None:
    """A dataset of ``docs`` raw documents (one of them empty: skipped) prepared at ``out`` (replacing it)."""
    from data_pipeline.prepare import prepare_dataset
    from tests.support.data_fixtures import write_corpus

    write_corpus(raw, seed, sizes=(docs, 1, 1))
    fresh = out.with_name(out.name + ".new")
    prepare_dataset([str(raw / "web.jsonl")], fresh, tok, name="web", num_workers=1, progress=False)
    if out.exists():
        shutil.rmtree(out)  # the test's own dataset, replaced as a user re-preparing it would
    fresh.rename(out)


def data_faults(base: str) -> dict:
    from data_pipeline.tokenizer import train_tokenizer
    from tests.support.data_fixtures import write_corpus

    _alone()
    base = Path(base)
    docs = write_corpus(base / "raw0", 0, sizes=(120, 1, 1))
    tok = str(base / "tok.model")
    train_tokenizer([t for _, t in docs["web"]], tok, vocab_size=320, num_threads=1)
    data_dir = base / "web"
    _prepare(base / "raw0", data_dir, tok, 120, 0)
    pipeline = {"sources": [{"name": "web", "path": str(data_dir), "weight": 1.0}], "tokenizer": tok,
                "seq_length": 32}
    run = base / "run"
    recipe = tiny_recipe(run, data={"source": "pipeline", "pipeline": pipeline}, model={"vocab_size": 320},
                         train={"steps": 2}, checkpoint={"at_end": True})
    out = {"train": _fbt_train(recipe, base)}
    longer = dict(recipe, train={**recipe["train"], "steps": 4})

    _prepare(base / "raw1", data_dir, tok, 120, 1)  # other documents, the same count
    before = _snapshot(run)
    out["same_count"] = _fbt_train(longer, base)
    out["same_count_unchanged"] = _snapshot(run) == before
    _prepare(base / "raw2", data_dir, tok, 150, 2)  # another count
    out["other_count"] = _fbt_train(longer, base)
    out["other_count_unchanged"] = _snapshot(run) == before
    # a deliberate change: allowed, recorded in metrics.jsonl and in the next checkpoint
    import data_pipeline.fingerprint as fingerprint

    reads, read = [], fingerprint.dataset_fingerprint
    fingerprint.dataset_fingerprint = lambda path: reads.append(str(path)) or read(path)
    try:
        out["allowed"] = _fbt_train(dict(longer, checkpoint={**recipe["checkpoint"], "allow_data_change": True}), base)
    finally:
        fingerprint.dataset_fingerprint = read
    out["allowed_fingerprint_reads"] = reads
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    out["allowed_events"] = [r for r in rows if r.get("event") == "data_changed"]
    out["allowed_steps"] = [r["step"] for r in rows if "event" not in r]
    state = json.loads((run / "checkpoints" / _latest(run) / "state.json").read_text())
    out["allowed_record"] = state["data"]
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return run_distributed(data_faults, 1, str(tmp_path_factory.mktemp("data_faults")))[0]


def test_a_dataset_replaced_under_a_run_is_refused_naming_the_source(data):
    assert data["train"][0] == 0, data["train"]
    for case, what in (("same_count", "the same 119 documents count but other content"),
                       ("other_count", "119 -> 149 documents")):
        rc, err = data[case]
        assert rc == 2 and err.count("\n") == 1, err  # one sentence, not a traceback about valid_documents
        assert "the data changed since checkpoint" in err and "source 'web'" in err and what in err, err
        assert "checkpoint.allow_data_change=true" in err
        assert data[f"{case}_unchanged"]


def test_a_deliberate_data_change_is_allowed_and_recorded(data):
    assert data["allowed"][0] == 0, data["allowed"]
    (event,) = data["allowed_events"]
    assert event["step"] == 2 and "119 -> 149 documents" in event["changes"][0]
    assert data["allowed_steps"] == [1, 2, 3, 4]
    record = data["allowed_record"]
    assert record["fingerprints"]["web"]["documents"] == 149
    assert record["changes"] == [{"step": 2, "changes": event["changes"]}]
    # the index is read by the launcher's plan and by the plan under the run lock; training uses the latter's
    assert len(data["allowed_fingerprint_reads"]) == 2
