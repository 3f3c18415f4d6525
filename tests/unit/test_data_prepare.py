"""`fbt data prepare`: parallel shard writing, resume after a crash, progress and throughput line."""

from __future__ import annotations

import json
import multiprocessing as mp
import fcntl
import os
import socket
import time

import numpy as np
import pytest

from data_pipeline import cli
from data_pipeline.prepare import _npy_bytes, prepare_dataset
from data_pipeline.shards import Dataset, verify_dataset
from data_pipeline.tokenizer import train_tokenizer
from tests.support.data_fixtures import write_corpus

SHARD = 6000


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("prep")
    docs = write_corpus(root / "raw", seed=1, sizes=(300, 20, 400))
    tok = root / "tok.model"
    train_tokenizer([t for v in docs.values() for _, t in v], tok, vocab_size=320, num_threads=1)
    inputs = [str(root / "raw" / "web.jsonl"), str(root / "raw" / "math.jsonl")]  # two input files
    ref = prepare_dataset(inputs, root / "ref", tok, name="mix", shard_bytes=SHARD, num_workers=1, progress=False)
    return {"root": root, "tok": str(tok), "inputs": inputs, "ref": root / "ref", "ref_index": ref}


def files_of(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name != "index.json"}


def test_npy_bytes_load_back():
    for arr in (np.arange(5, dtype=np.uint16), np.zeros(0, np.uint16), np.arange(70000, dtype=np.int32)):
        import io

        got = np.load(io.BytesIO(_npy_bytes(arr)))
        assert got.dtype == arr.dtype and np.array_equal(got, arr)


def test_two_workers_write_the_same_dataset(corpus, tmp_path):
    idx = prepare_dataset(corpus["inputs"], tmp_path / "two", corpus["tok"], name="mix", shard_bytes=SHARD,
                          num_workers=2, progress=False)
    assert idx["num_shards"] > 5 and idx["prepare"]["workers"] == 2
    assert files_of(tmp_path / "two") == files_of(corpus["ref"])
    assert verify_dataset(tmp_path / "two")["tokens"] == idx["num_tokens"]
    assert not (tmp_path / "two.tmp").exists()


def _crash_after(inputs, out, tok, n_docs):
    """Run prepare in this (forked) process and die abruptly (no cleanup) after reading n_docs documents."""
    from data_pipeline.sources import iter_documents

    def docs():
        for i, d in enumerate(iter_documents(inputs)):
            if i == n_docs:
                os._exit(3)
            yield d

    prepare_dataset([], out, tok, name="mix", shard_bytes=SHARD, num_workers=1, progress=False, documents=docs(),
                    extra_meta={"inputs": inputs})


def test_prepare_resumes_after_a_crash_keeping_finished_shards(corpus, tmp_path, capsys):
    out = tmp_path / "mix"
    tmp = tmp_path / "mix.tmp"
    kw = dict(name="mix", shard_bytes=SHARD, extra_meta={"inputs": corpus["inputs"]})
    p = mp.get_context("fork").Process(target=_crash_after, args=(corpus["inputs"], out, corpus["tok"], 400))
    p.start()
    p.join(120)
    assert p.exitcode == 3  # crashed
    assert not out.exists() and tmp.is_dir()  # a half-written dataset never looks done
    finished = sorted(tmp.glob("shard-*.tar"))
    assert len(finished) >= 3
    stamps = {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in finished}
    (tmp / "shard-000999.tar.part").write_bytes(b"half a shard")  # what a kill during a write leaves

    from data_pipeline.sources import iter_documents

    idx = prepare_dataset([], out, corpus["tok"], num_workers=2, progress=True,
                          documents=iter_documents(corpus["inputs"]), **kw)
    assert idx["prepare"]["resumed_shards"] == len(finished)
    for f in finished:  # kept, not rewritten
        st = (out / f.name).stat()
        assert (st.st_ino, st.st_mtime_ns) == stamps[f.name]
    assert not list(out.glob("*.part*")) and not list(out.glob("*.meta.npz"))
    assert files_of(out) == files_of(corpus["ref"])  # identical to an uninterrupted run
    err = capsys.readouterr().err
    assert "prepare mix" in err  # tqdm bar
    assert f"{len(finished)} finished shards kept" in err and "tokens/s with 2 worker(s)" in err


def test_prepare_starts_over_when_settings_changed(corpus, tmp_path):
    from data_pipeline.sources import iter_documents

    def broken():
        for i, d in enumerate(iter_documents(corpus["inputs"])):
            if i == 300:
                raise RuntimeError("disk on fire")
            yield d

    out = tmp_path / "mix"
    with pytest.raises(RuntimeError, match="disk on fire"):
        prepare_dataset([], out, corpus["tok"], name="mix", shard_bytes=SHARD, num_workers=2, progress=False,
                        documents=broken())
    assert len(list((tmp_path / "mix.tmp").glob("shard-*.tar"))) >= 2
    # other shard size: the finished shards do not fit, everything is redone
    idx = prepare_dataset(corpus["inputs"], out, corpus["tok"], name="mix", shard_bytes=2 * SHARD, num_workers=1,
                          progress=False)
    assert idx["prepare"]["resumed_shards"] == 0
    assert Dataset.load(out).num_samples == corpus["ref_index"]["num_samples"]


def test_cli_prepare_prints_throughput(corpus, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = cli.main(["prepare", "--input", *corpus["inputs"], "--tokenizer", corpus["tok"], "--out", str(out),
                   "--name", "mix", "--shard-mb", str(SHARD / (1 << 20)), "--workers", "2"])
    assert rc == 0
    cap = capsys.readouterr()
    summary = json.loads(cap.out)
    assert summary["shards"] == corpus["ref_index"]["num_shards"] and summary["prepare"]["tokens_per_s"] > 0
    assert "tokens/s with 2 worker(s)" in cap.err
    assert json.loads((out / "index.json").read_text())["format_version"] == 2


def test_a_second_concurrent_prepare_is_refused(corpus, tmp_path):
    from data_pipeline.errors import SourceError
    from data_pipeline.prepare import exclusive_lock

    held = exclusive_lock(tmp_path / "mix.lock", "")  # as a running prepare holds it
    try:
        with pytest.raises(SourceError, match=rf"another `fbt data prepare` is writing .*mix\.tmp: wait for it or stop "
                                              rf"it \(pid {os.getpid()} on {socket.gethostname()}; lock .*mix\.lock\)"):
            prepare_dataset(corpus["inputs"], tmp_path / "mix", corpus["tok"], shard_bytes=SHARD, progress=False)
    finally:
        held.close()
    idx = prepare_dataset(corpus["inputs"], tmp_path / "mix", corpus["tok"], shard_bytes=SHARD, progress=False)
    assert idx["num_samples"] == corpus["ref_index"]["num_samples"] and not (tmp_path / "mix.lock").exists()


def test_the_lock_names_its_holder_and_goes_on_unlocked_where_the_file_system_has_no_locks(tmp_path, monkeypatch,
                                                                                         caplog):
    """One lock for fbt data prepare and the job array's tokenize tasks (data_pipeline/array.py)."""
    import errno

    from data_pipeline import prepare
    from data_pipeline.errors import SourceError

    held = prepare.exclusive_lock(tmp_path / "locks" / "slice-00003.lock", "")
    try:
        with pytest.raises(SourceError, match=rf"^another process is tokenizing slice 3 \(pid {os.getpid()} on "
                                              rf"{socket.gethostname()}; lock "):
            prepare.exclusive_lock(tmp_path / "locks" / "slice-00003.lock", "another process is tokenizing slice 3")
    finally:
        held.close()

    def no_locks(fh, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(prepare.fcntl, "flock", no_locks)
    with caplog.at_level("WARNING", logger="data_pipeline.prepare"):
        unlocked = prepare.exclusive_lock(tmp_path / "nfs.lock", "busy")
    unlocked.close()
    assert "no lock on this file system" in caplog.text
    assert (tmp_path / "nfs.lock").read_text() == f"{os.getpid()} {socket.gethostname()} {os.getpgid(0)}"


def test_a_lock_whose_process_group_is_gone_is_taken_over_and_a_live_one_refused(tmp_path, monkeypatch, caplog):
    """The lock file names pid, host and process group. A lock still held (flock) for a group that is gone
    (what orphans of a killed prepare left) is taken over; for a live group it is refused, naming pid and host.
    On a file system without locks, a holder still running on this host is refused the same way."""
    import errno
    import subprocess
    import sys

    from data_pipeline import prepare
    from data_pipeline.errors import SourceError

    host = socket.gethostname()
    lock = tmp_path / "mix.lock"
    fh = open(lock, "w")
    child = os.fork()
    if child == 0:  # holds the flock until killed
        fcntl.flock(fh, fcntl.LOCK_EX)
        time.sleep(60)
        os._exit(0)
    fh.close()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        for _ in range(100):
            try:
                fcntl.flock(open(lock), fcntl.LOCK_EX | fcntl.LOCK_NB)
                time.sleep(0.05)  # the child has not taken it yet
            except BlockingIOError:
                break
        lock.write_text(f"{holder.pid} {host} {holder.pid}")  # the recorded holder: a group of its own
        with pytest.raises(SourceError, match=rf"^busy \(pid {holder.pid} on {host}; lock {lock}\)$"):
            prepare.exclusive_lock(lock, "busy")
    finally:
        holder.kill()
        holder.wait()
    with caplog.at_level("WARNING", logger="data_pipeline.prepare"):
        prepare.exclusive_lock(lock, "busy").close()  # the group is gone: taken over
    assert f"taking over the lock of pid {holder.pid}" in caplog.text
    os.kill(child, 9)
    os.waitpid(child, 0)

    def no_locks(fh, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(prepare.fcntl, "flock", no_locks)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.write_text(f"{sleeper.pid} {host} {sleeper.pid}")
        with pytest.raises(SourceError, match=rf"^busy \(pid {sleeper.pid} on {host}; lock {lock}\)$"):
            prepare.exclusive_lock(lock, "busy")
        assert lock.read_text() == f"{sleeper.pid} {host} {sleeper.pid}"  # not touched
    finally:
        sleeper.kill()
        sleeper.wait()
    prepare.exclusive_lock(lock, "busy").close()  # a holder that has ended: its file is left behind
    assert lock.read_text() == f"{os.getpid()} {host} {os.getpgid(0)}"
