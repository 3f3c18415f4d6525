"""`fbt data prepare` as a job array (data_pipeline/array.py), its stages run in-process: N slices of the
input's units (files, Parquet row groups, Arrow files), counted, tokenized and merged, give the token
stream of a one-process prepare of the same inputs, for any N; a task stopped part-way keeps its
finished shards; bad rows, changed inputs and a merge before the tasks are errors naming the problem.
(tests/test_slurm_prepare.py runs the same stages as SLURM job arrays.)"""

import json

import numpy as np
import pytest

from data_pipeline import array
from data_pipeline.errors import SourceError
from data_pipeline.prepare import prepare_dataset
from data_pipeline.shards import Dataset, DatasetReader
from data_pipeline.testing import WORDS, train_hf_bpe

TEXTS = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(5 + i % 23)) + f". {i * 37} + {i} = {i * 38}\n"
         for i in range(150)]
SHARD = 400  # bytes: several shards per slice


def write_corpus(root, texts=TEXTS, bad_line: int | None = None):
    """A Parquet file (row groups of 9), a .jsonl.zst, a plain JSONL (with an empty record), a text file
    and a datasets save of 3 Arrow files: 11 + 1 + 1 + 1 + 3 units."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    root.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts[:100]}), root / "a.parquet",  # no id column: ids name the row
                   row_group_size=9)
    lines = [json.dumps({"text": t}) for t in texts[100:120]]
    if bad_line is not None:
        lines[bad_line] = "{not json"
    (root / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(("\n".join(lines) + "\n").encode()))
    (root / "c.jsonl").write_text("".join(json.dumps({"text": t, "id": f"c{i}"}) + "\n" for i, t in enumerate(
        texts[120:130] + [""])))
    (root / "d.txt").write_text(texts[130])
    datasets.Dataset.from_dict({"text": texts[131:]}).save_to_disk(str(root / "e"), num_shards=3)
    return [str(root / n) for n in ("a.parquet", "b.jsonl.zst", "c.jsonl", "d.txt", "e")]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("array")
    inputs = write_corpus(root / "in")
    tok = train_hf_bpe(TEXTS, root / "tok", vocab_size=200)
    ref = prepare_dataset(inputs, root / "ref", tok, name="corpus", shard_bytes=SHARD, progress=False)
    return {"root": root, "inputs": inputs, "tok": tok, "ref": root / "ref", "ref_index": ref}


def run_array(inputs, out, tok, n, *, workers=1, **kw):
    adir, plan, state = array.write_plan(inputs, out, tok, n, name="corpus", shard_bytes=SHARD, **kw)
    for i in range(n):
        array.count_slice(adir, i)
    for i in range(n):
        array.tokenize_slice(adir, i, num_workers=workers)
    return adir, array.merge(adir)


def samples(path):
    """Every document's tokens and metadata, in sample-id order, read through the shards."""
    import tarfile

    ds = Dataset.load(path)
    reader = DatasetReader(ds)
    toks = [reader.get(i).tolist() for i in range(ds.num_samples)]
    metas = []
    for shard in sorted(path.glob("shard-*.tar")):
        with tarfile.open(shard) as tf:
            metas += [json.load(tf.extractfile(m)) for m in tf.getmembers() if m.name.endswith(".json")]
    return toks, metas


def assert_same_stream(out, ref, tok):
    a, b = json.loads((out / "index.json").read_text()), json.loads((ref / "index.json").read_text())
    differ = {"num_shards", "seconds", "prepare"}  # shards restart at each slice; timings
    assert {k: v for k, v in a.items() if k not in differ} == {k: v for k, v in b.items() if k not in differ}
    for f in ("lengths.npy", "crc32.npy"):
        assert np.array_equal(np.load(out / f), np.load(ref / f)), f
    assert samples(out) == samples(ref)
    from data_pipeline.config import DataConfig, SourceConfig
    from data_pipeline.testing import assert_same_batches, global_stream

    def cfg(p):
        return DataConfig(sources=[SourceConfig(name="c", path=str(p), weight=1.0)], tokenizer=str(tok), seq_length=24)

    assert_same_batches(global_stream(cfg(out), 6)[0], global_stream(cfg(ref), 6)[0])


def test_units_read_in_order_are_the_documents(corpus):
    from data_pipeline.sources import iter_documents, iter_units, list_units

    units = list_units(corpus["inputs"])
    assert [u.kind for u in units] == ["parquet"] * 12 + ["file"] * 3 + ["arrow"] * 3
    assert [u.first_row for u in units[:3]] == [0, 9, 18] and units[-1].first_row > 0
    want_counts, got_counts = {}, {}
    want = list(iter_documents(corpus["inputs"], counts=want_counts))
    assert list(iter_units(units, counts=got_counts)) == want
    assert {k: v for k, v in want_counts.items() if k != "files"} == got_counts
    # any cut into contiguous slices reads the same stream
    for n in (2, 3, 7):
        slices = array.split_units(units, n)
        assert sorted(k for s in slices for k in s) == list(range(len(units)))
        assert all(s == list(range(s[0], s[-1] + 1)) for s in slices if s)
        assert [d for s in slices for d in iter_units([units[k] for k in s])] == want


@pytest.mark.parametrize("n", [1, 3, 5])
def test_array_equals_one_process(corpus, tmp_path, n):
    adir, index = run_array(corpus["inputs"], tmp_path / "out", corpus["tok"], n, workers=2 if n == 3 else 1)
    plan = array.load_plan(adir)
    assert sum(1 for s in plan["slices"] if s) == n  # every task had work
    assert index["num_shards"] >= n and index["prepare"]["array_tasks"] == n
    assert not (adir / "shards").exists() and not list((tmp_path / "out").glob("*.meta*"))
    assert_same_stream(tmp_path / "out", corpus["ref"], corpus["tok"])
    # again: merged already, nothing to do
    assert array.write_plan(corpus["inputs"], tmp_path / "out", corpus["tok"], n, name="corpus",
                            shard_bytes=SHARD)[2] == "merged"


def test_stopped_task_resumes_keeping_finished_shards(corpus, tmp_path, monkeypatch):
    from data_pipeline import prepare

    adir, _, state = array.write_plan(corpus["inputs"], tmp_path / "out", corpus["tok"], 3, name="corpus",
                                      shard_bytes=SHARD)
    assert state == "new"
    for i in range(3):
        array.count_slice(adir, i)
    array.tokenize_slice(adir, 0)
    write, calls = prepare._write_shard, []

    def dies_on_third(task):
        calls.append(task[0])
        if len(calls) == 3:
            raise KeyboardInterrupt  # the task is killed while writing its third shard
        return write(task)

    monkeypatch.setattr(prepare, "_write_shard", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        array.tokenize_slice(adir, 1)
    monkeypatch.setattr(prepare, "_write_shard", write)
    shards = adir / "shards"
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in shards.glob("shard-*.tar")}
    assert len(before) == len((array._read_json(adir / "done" / "slice-00000.json"))["infos"]) + 2
    with pytest.raises(SourceError, match=r"slices \[1, 2\] are not tokenized"):
        array.merge(adir)
    # the same submission again: same plan, the finished work is kept
    assert array.write_plan(corpus["inputs"], tmp_path / "out", corpus["tok"], 3, name="corpus",
                            shard_bytes=SHARD)[2] == "resume"
    seen = []
    monkeypatch.setattr(prepare, "_write_shard", lambda task: seen.append(task[0]) or write(task))
    for i in range(3):
        array.count_slice(adir, i)
        array.tokenize_slice(adir, i)
    assert seen and seen[0] == calls[2] and not set(seen) & {int(n[6:12]) for n in before}  # nothing redone
    rec = array._read_json(adir / "done" / "slice-00001.json")
    assert rec["kept_shards"] == 2
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in shards.glob("shard-*.tar")}
    assert all(after[k] == v for k, v in before.items())
    array.merge(adir)
    assert_same_stream(tmp_path / "out", corpus["ref"], corpus["tok"])


def test_bad_row_named_as_one_process_does(corpus, tmp_path):
    inputs = write_corpus(tmp_path / "in", bad_line=4)
    with pytest.raises(SourceError) as one:
        prepare_dataset(inputs, tmp_path / "one", corpus["tok"], shard_bytes=SHARD, progress=False)
    adir, _, _ = array.write_plan(inputs, tmp_path / "out", corpus["tok"], 3, shard_bytes=SHARD)
    with pytest.raises(SourceError) as arr:
        for i in range(3):
            array.count_slice(adir, i)
    assert str(arr.value) == str(one.value) and "b.jsonl.zst:5: invalid JSON" in str(arr.value)
    # skipped and counted: the same counts as one process
    ref = prepare_dataset(inputs, tmp_path / "one", corpus["tok"], shard_bytes=SHARD, progress=False,
                          skip_bad_rows=True)
    _, index = run_array(inputs, tmp_path / "out", corpus["tok"], 3, skip_bad_rows=True)
    assert index["skipped_bad_rows"] == ref["skipped_bad_rows"] == 1
    assert index["first_bad_row"] == ref["first_bad_row"]
    assert index["skipped_empty_documents"] == ref["skipped_empty_documents"] == 1


def test_changed_input_and_early_merge_are_refused(corpus, tmp_path):
    inputs = write_corpus(tmp_path / "in")
    adir, _, _ = array.write_plan(inputs, tmp_path / "out", corpus["tok"], 2, shard_bytes=SHARD)
    with pytest.raises(SourceError, match="slice 0 has not been counted"):
        array.tokenize_slice(adir, 1)
    array.count_slice(adir, 0)
    array.count_slice(adir, 1)
    with pytest.raises(SourceError, match=r"slices \[0, 1\] are not tokenized"):
        array.merge(adir)
    with pytest.raises(SourceError, match="task 2 is outside the plan's 2 tasks"):
        array.count_slice(adir, 2)
    last = tmp_path / "in" / "e"  # slice 1's input changes under the array
    arrow = sorted(last.glob("*.arrow"))[-1]
    arrow.write_bytes(arrow.read_bytes())
    import os

    os.utime(arrow, ns=(1, 1))
    with pytest.raises(SourceError, match=f"input {arrow} changed"):
        array.tokenize_slice(adir, 1)
    assert not (tmp_path / "out").exists()
    # a new plan (the inputs changed): the old work is dropped
    assert array.write_plan(inputs, tmp_path / "out", corpus["tok"], 2, shard_bytes=SHARD)[2] == "new"
    assert not (adir / "counts").exists()
