"""Bad inputs and faults of data preparation, as a careless or unlucky user meets them: each case asserts
the sentence the user sees, the exit code, and that nothing was lost (docs/reliability.md lists them)."""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_pipeline import cli
from tests.support.data_fixtures import write_corpus

ROOT = Path(__file__).resolve().parents[2]
SHARD_MB = str(6000 / (1 << 20))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from data_pipeline.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("bad-data")
    docs = write_corpus(root / "raw", seed=3, sizes=(120, 5, 200))
    tok = root / "tok.model"
    train_tokenizer([t for v in docs.values() for _, t in v], tok, vocab_size=320, num_threads=1)
    return {"web": str(root / "raw" / "web.jsonl"), "math": str(root / "raw" / "math.jsonl"), "tok": str(tok),
            "n_web": len(docs["web"]), "n_math": len(docs["math"])}


def prepare(corpus, out, *extra, source="web"):
    return cli.main(["prepare", "--input", corpus[source], "--tokenizer", corpus["tok"], "--out", str(out),
                     "--shard-mb", SHARD_MB, "--workers", "1", "--quiet", *extra])


def snapshot(d: Path) -> dict:
    """Every file under ``d``: its bytes, inode and mtime (what was kept, and whether it was rewritten)."""
    return {str(p.relative_to(d)): (p.read_bytes(), p.stat().st_ino, p.stat().st_mtime_ns)
            for p in sorted(d.rglob("*")) if p.is_file()}


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def user_dir(tmp_path) -> Path:
    d = tmp_path / "mine"
    (d / "drafts").mkdir(parents=True)
    (d / "notes.txt").write_text("three weeks of notes")
    (d / "drafts" / "a.md").write_text("draft")
    return d


@pytest.mark.parametrize("overwrite", [False, True])
def test_prepare_into_a_directory_of_user_files_is_refused_and_the_files_stay(corpus, tmp_path, capsys, overwrite):
    d = user_dir(tmp_path)
    before = snapshot(d)
    assert prepare(corpus, d, *(["--overwrite"] if overwrite else [])) == 2
    assert error_line(capsys) == (f"error: --out {d} holds drafts/ and notes.txt, which fbt data prepare did not "
                                  "write: nothing was changed; choose a new or empty directory, or move them away")
    assert snapshot(d) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no mine.tmp, no mine.lock


def test_prepare_onto_a_file_is_refused(corpus, tmp_path, capsys):
    f = tmp_path / "data.jsonl"
    f.write_text("precious")
    assert prepare(corpus, f) == 2
    assert error_line(capsys) == (f"error: --out {f} is a file, not a directory: nothing was changed; choose a new "
                                  "or empty directory")
    assert f.read_text() == "precious"


def test_the_same_dataset_again_is_kept_as_it_is(corpus, tmp_path, capsys):
    out = tmp_path / "web"
    assert prepare(corpus, out) == 0
    first = json.loads(capsys.readouterr().out)
    before = snapshot(out)
    assert cli.main(["prepare", "--input", corpus["web"], "--tokenizer", corpus["tok"], "--out", str(out),
                     "--shard-mb", SHARD_MB, "--workers", "2"]) == 0
    cap = capsys.readouterr()
    assert f"prepare web: {out} already holds this dataset" in cap.err and "nothing written" in cap.err
    assert json.loads(cap.out)["num_samples"] == first["num_samples"] == corpus["n_web"]
    assert snapshot(out) == before  # not rewritten (same inodes and mtimes)


def test_another_dataset_is_replaced_only_with_overwrite(corpus, tmp_path, capsys):
    out = tmp_path / "web"
    assert prepare(corpus, out) == 0
    capsys.readouterr()
    before = snapshot(out)
    assert prepare(corpus, out, source="math") == 2
    assert error_line(capsys) == (f"error: --out {out} holds a dataset of other inputs or settings ({corpus['n_web']} "
                                  "documents of 'web'): nothing was changed; pass --overwrite to replace it, or "
                                  "choose another directory")
    assert snapshot(out) == before
    assert prepare(corpus, out, "--overwrite", source="math") == 0
    assert json.loads(capsys.readouterr().out)["num_samples"] == corpus["n_math"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["web"]  # nothing left aside


def test_overwrite_never_replaces_a_dataset_that_holds_user_files(corpus, tmp_path, capsys):
    out = tmp_path / "web"
    assert prepare(corpus, out) == 0
    (out / "README.md").write_text("how I made this")
    before = snapshot(out)
    assert prepare(corpus, out, "--overwrite", source="math") == 2
    assert error_line(capsys).startswith(f"error: --out {out} holds README.md, which fbt data prepare did not write")
    assert snapshot(out) == before


def test_a_user_directory_named_like_the_work_directory_is_not_removed(corpus, tmp_path, capsys):
    d = user_dir(tmp_path)
    work = tmp_path / "web.tmp"
    d.rename(work)
    before = snapshot(work)
    assert prepare(corpus, tmp_path / "web") == 2
    assert error_line(capsys).startswith(f"error: the work directory {work} holds drafts/ and notes.txt, which fbt data "
                                         "prepare did not write")
    assert snapshot(work) == before and not (tmp_path / "web").exists()


def test_embedded_build_into_a_directory_of_user_files_is_refused(tmp_path, capsys):
    d = user_dir(tmp_path)
    before = snapshot(d)
    assert cli.main(["embedded", "--out", str(d), "--quiet"]) == 2
    assert error_line(capsys).startswith(f"error: --out {d} holds drafts/ and notes.txt, which fbt data embedded did "
                                         "not write: nothing was changed")
    assert snapshot(d) == before


def test_a_research_run_folder_of_user_files_is_refused(tmp_path):
    from data_pipeline.output_dir import OutputDirError
    from fbt_megatron.research.runs import train_run

    d = user_dir(tmp_path)
    before = snapshot(d)
    with pytest.raises(OutputDirError, match=rf"^run folder {d} holds drafts/ and notes.txt, which a research run did "
                                             "not write: nothing was changed"):
        train_run("recipes/tiny.yaml", d, ["train.steps=1"])
    assert snapshot(d) == before


def test_a_research_run_folder_holding_a_user_file_beside_the_run_is_kept(tmp_path):
    """A folder a research run started (its command.json) but where the user also keeps a file: another run
    there is refused, and the file and the earlier run stay."""
    from data_pipeline.output_dir import OutputDirError
    from fbt_megatron.research.runs import train_run

    d = tmp_path / "run"
    (d / "checkpoints").mkdir(parents=True)
    (d / "command.json").write_text('["recipes/tiny.yaml"]')
    (d / "metrics.jsonl").write_text("{}\n")
    (d / "my_analysis.ipynb").write_text("the user's")
    before = snapshot(d)
    with pytest.raises(OutputDirError, match=r"holds my_analysis.ipynb, which a research run did not write"):
        train_run("recipes/tiny.yaml", d, ["train.steps=1"])
    assert snapshot(d) == before


@pytest.mark.parametrize("argv, message", [
    (["prepare", "--shard-mb", "-1"], "argument --shard-mb: must be a number > 0 (got -1)"),
    (["prepare", "--shard-mb", "0"], "argument --shard-mb: must be a number > 0 (got 0)"),
    (["prepare", "--shard-mb", "nan"], "argument --shard-mb: must be a number > 0 (got nan)"),
    (["prepare", "--workers", "0"], "argument --workers: must be an integer >= 1 (got 0)"),
    (["prepare", "--workers", "two"], "argument --workers: 'two' is not an integer"),
    (["prepare", "--max-tokens", "0"], "argument --max-tokens: must be an integer >= 1 (got 0)"),
    (["tokenizer", "--vocab-size", "0"], "argument --vocab-size: must be an integer >= 1 (got 0)"),
    (["tokenizer", "--max-sentences", "-5"], "argument --max-sentences: must be an integer >= 1 (got -5)"),
    (["prepare-task", "tokenize", "--plan", "p", "--task", "-1"], "argument --task: must be an integer >= 0 (got -1)"),
    (["prepare-task", "tokenize", "--plan", "p", "--workers", "0"], "argument --workers: must be an integer >= 1 (got 0)"),
    (["embedded", "--code-mb", "-1"], "argument --code-mb: must be a number > 0 (got -1)"),
    (["embedded", "--prose-mb", "inf"], "argument --prose-mb: must be a number > 0 (got inf)"),
    (["embedded", "--math-docs", "0"], "argument --math-docs: must be an integer >= 1 (got 0)"),
    (["embedded", "--vocab-size", "-1"], "argument --vocab-size: must be an integer >= 1 (got -1)"),
    (["embedded", "--seed", "-1"], "argument --seed: must be an integer >= 0 (got -1)"),
    (["embedded", "--seq-length", "0"], "argument --seq-length: must be an integer >= 1 (got 0)"),
    (["embedded", "--workers", "0"], "argument --workers: must be an integer >= 1 (got 0)"),
    (["peek", "r.yaml", "--sequences", "0"], "argument --sequences: must be an integer >= 1 (got 0)"),
    (["peek", "r.yaml", "--start", "-1"], "argument --start: must be an integer >= 0 (got -1)"),
])
def test_numeric_flags_out_of_bounds_are_refused_before_anything_is_written(corpus, tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    base = {"prepare": ["--input", corpus["web"], "--tokenizer", corpus["tok"], "--out", str(out)],
            "tokenizer": ["--input", corpus["web"], "--out", str(out / "tok.model")],
            "embedded": ["--out", str(out)]}.get(argv[0], [])
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv[:1], *base, *argv[1:]])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].endswith(f"error: {message}") and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_is_one_sentence_and_a_rerun_resumes(corpus, tmp_path, capsys, monkeypatch):
    """ENOSPC from the second shard's write (the disk fills): one sentence with the path, the space free
    against what is still to write, the shard kept; the same command again resumes from it."""
    from data_pipeline import prepare as prep

    opened = []

    class FullDisk(io.FileIO):
        def write(self, b):
            if len(opened) > 1:  # the disk fills during the second shard
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write(b)

    def small_disk_open(file, mode="r", *args, **kwargs):
        if "w" in mode and "b" in mode:
            opened.append(file)
            return io.BufferedWriter(FullDisk(file, "w"))
        return open(file, mode, *args, **kwargs)

    out, work = tmp_path / "web", tmp_path / "web.tmp"
    monkeypatch.setattr(prep, "open", small_disk_open, raising=False)
    assert prepare(corpus, out) == 2
    line = error_line(capsys)
    assert line.startswith(f"error: no space left on the device writing {work} (")
    assert " MB free against about " in line and " MB still to write (estimated from the inputs' size)): " in line
    assert line.endswith(f"1 finished shard kept in {work}; free space and run the same command again to resume")
    assert "ValueError" not in line and not out.exists()
    kept = snapshot(work)["shard-000000.tar"]
    monkeypatch.undo()
    assert prepare(corpus, out) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["prepare"]["resumed_shards"] == 1 and summary["num_samples"] == corpus["n_web"]
    assert snapshot(out)["shard-000000.tar"][:2] == kept[:2]  # the kept shard itself, not rewritten


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie waits for its (new) parent to reap it: dead


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_killed_multi_worker_prepare_leaves_no_worker_and_a_rerun_succeeds(corpus, tmp_path, capsys):
    held, out = tmp_path / "held", tmp_path / "web"
    held.mkdir()
    env = dict(os.environ, FBT_TEST_HOLD_PREPARE_WORKERS=str(held),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    parent = subprocess.Popen([sys.executable, "-m", "tests.support.hold_prepare", "data", "prepare", "--input",
                               corpus["web"], "--tokenizer", corpus["tok"], "--out", str(out), "--shard-mb", SHARD_MB,
                               "--workers", "2", "--quiet"], cwd=ROOT, env=env, start_new_session=True)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2 and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.2)
            workers = [int(p.name.split("-")[1]) for p in held.iterdir()]
        assert len(workers) == 2, f"the workers did not start (exit code {parent.poll()})"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 5
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, workers)), "workers outlived their killed parent"
    finally:
        for pid in [parent.pid] * (parent.poll() is None) + [w for w in workers if _alive(w)]:
            os.kill(pid, signal.SIGKILL)
    assert prepare(corpus, out) == 0  # the lock is free: the same command runs to the end
    assert json.loads(capsys.readouterr().out)["num_samples"] == corpus["n_web"]
