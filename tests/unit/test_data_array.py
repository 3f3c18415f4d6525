"""`fbt data prepare` as a job array (data_pipeline/array.py), its stages run in-process: N slices of the
input's units (files, Parquet row groups, Arrow files), counted, tokenized and merged, give the token
stream of a one-process prepare of the same inputs, for any N; a task stopped part-way keeps its
finished shards; bad rows, changed inputs and a merge before the tasks are errors naming the problem.
(tests/integration/test_slurm_prepare.py runs the same stages as SLURM job arrays.)"""

import pytest

from data_pipeline import array
from data_pipeline.errors import SourceError
from data_pipeline.prepare import prepare_dataset
from tests.support.data_fixtures import train_hf_bpe

from tests.support.array_helpers import SHARD, TEXTS, assert_same_stream, write_corpus

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


@pytest.mark.parametrize("n", [1, 3, 5, 24])
def test_array_equals_one_process(corpus, tmp_path, n):
    adir, index = run_array(corpus["inputs"], tmp_path / "out", corpus["tok"], n, workers=2 if n == 3 else 1)
    plan = array.load_plan(adir)
    # every task had work, except where there are more tasks than units (18): empty slices write nothing
    assert sum(1 for s in plan["slices"] if s) == min(n, len(plan["units"]))
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


def test_submit_prepare_dry_run_renders_the_arrays(corpus, tmp_path):
    from fbt_megatron.launch.prepare_array import PrepareSpec, SubmitError, submit_prepare

    spec = PrepareSpec(inputs=corpus["inputs"], out=str(tmp_path / "out"), tokenizer=str(corpus["tok"]), tasks=3,
                       workers=2, shard_mb=SHARD / (1 << 20), partition="cpu")
    printed = []
    recs = submit_prepare(spec, dry_run=True, print_fn=printed.append)
    assert [r["stage"] for r in recs] == ["count", "tokenize", "merge"]
    count, tokenize, merge = printed[1:]
    assert printed[0].startswith(f"plan {tmp_path / 'out.array' / 'plan.json'} (new, not written: a dry run): ")
    assert "#SBATCH --array=0-2" in count and "#SBATCH --array=0-2" in tokenize and "--array" not in merge
    assert "#SBATCH --dependency=afterok:<count>" in tokenize and "#SBATCH --dependency=afterok:<tokenize>" in merge
    assert "#SBATCH --cpus-per-task=2" in tokenize and "#SBATCH --cpus-per-task=1" in count
    assert f"data prepare-task tokenize --plan {tmp_path / 'out.array'} --workers 2" in tokenize
    assert "%A_%a.out" in tokenize and "#SBATCH --partition=cpu" in merge
    assert not (tmp_path / "out.array").exists()  # a dry run writes nothing
    with pytest.raises(SubmitError, match="--array 0"):
        submit_prepare(PrepareSpec(**{**spec.__dict__, "tasks": 0}), dry_run=True)


def test_submit_prepare_refused_leaves_only_its_plan(corpus, tmp_path, monkeypatch):
    """A --time sbatch cannot parse is refused before the plan is written; a script sbatch refuses is
    removed with the log folder it made, and the plan stays for the next submit to resume."""
    import os

    from fbt_megatron.launch.prepare_array import PrepareSpec, SubmitError, submit_prepare

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: nosuch' >&2\n"
                                    "echo 'sbatch: error: Batch job submission failed' >&2\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    spec = PrepareSpec(inputs=corpus["inputs"], out=str(tmp_path / "out"), tokenizer=str(corpus["tok"]), tasks=2,
                       workers=1, shard_mb=SHARD / (1 << 20), time="25h")
    with pytest.raises(SubmitError, match=r"^--time '25h' is not a SLURM time limit"):
        submit_prepare(spec, print_fn=lambda *a: None)
    assert not (tmp_path / "out.array").exists()
    spec.time = "04:00:00"
    with pytest.raises(SubmitError, match=r"^sbatch refused the job: sbatch: error: invalid partition specified: "
                                          r"nosuch; sbatch: error: Batch job submission failed$"):
        submit_prepare(spec, print_fn=lambda *a: None)
    assert sorted(p.name for p in (tmp_path / "out.array").iterdir()) == ["plan.json"]
    # the count stage queued, the tokenize stage refused: the queued job is named with what to do
    (bin_dir / "sbatch").write_text("#!/bin/sh\ncase \"$2\" in *-tokenize.*) echo 'sbatch: error: bad' >&2; exit 1;; "
                                    "esac\necho 4242\n")
    with pytest.raises(SubmitError, match=r"^sbatch refused the job: sbatch: error: bad; count as job 4242 queued: "
                                          r"scancel 4242 and submit again$"):
        submit_prepare(spec, print_fn=lambda *a: None)


def test_array_with_bos_equals_one_process(corpus, tmp_path):
    ref = prepare_dataset(corpus["inputs"], tmp_path / "ref", corpus["tok"], name="corpus", shard_bytes=SHARD,
                          progress=False, bos="yes")
    _, index = run_array(corpus["inputs"], tmp_path / "out", corpus["tok"], 2, bos="yes")
    assert index["bos_added_id"] == ref["bos_added_id"] is not None
    assert_same_stream(tmp_path / "out", tmp_path / "ref", corpus["tok"])


def test_merge_refuses_a_missing_or_rewritten_shard(corpus, tmp_path):
    adir, _, _ = array.write_plan(corpus["inputs"], tmp_path / "out", corpus["tok"], 2, name="corpus",
                                  shard_bytes=SHARD)
    for stage in (array.count_slice, array.tokenize_slice):
        for i in range(2):
            stage(adir, i)
    shard = adir / "shards" / "shard-000003.tar"
    data = shard.read_bytes()
    shard.write_bytes(data[:-512])
    with pytest.raises(SourceError, match="shard-000003.tar is missing or its size differs"):
        array.merge(adir)
    shard.unlink()
    with pytest.raises(SourceError, match="shard-000003.tar is missing or its size differs"):
        array.merge(adir)
    assert not (tmp_path / "out").exists()
    shard.write_bytes(data)  # put back: the merge goes through
    array.merge(adir)
    assert_same_stream(tmp_path / "out", corpus["ref"], corpus["tok"])


def _planned_and_tokenized(corpus, out, tok, n=2, **kw):
    adir, _, _ = array.write_plan(corpus["inputs"], out, tok, n, name="corpus", shard_bytes=SHARD, **kw)
    for stage in (array.count_slice, array.tokenize_slice):
        for i in range(n):
            stage(adir, i)
    return adir


def test_a_tokenizer_changed_after_the_plan_is_refused(corpus, tmp_path):
    """Tasks run long after submission: a tokenizer whose files changed since the plan is refused by the
    tasks still to run and by the merge, naming it, before anything is written."""
    import shutil

    tok = tmp_path / "tok"
    shutil.copytree(corpus["tok"], tok)
    adir, _, _ = array.write_plan(corpus["inputs"], tmp_path / "out", tok, 2, name="corpus", shard_bytes=SHARD)
    for i in range(2):
        array.count_slice(adir, i)
    array.tokenize_slice(adir, 0)
    other = train_hf_bpe(TEXTS, tmp_path / "other", vocab_size=400)  # with merges: another tokenizer
    shutil.rmtree(tok)
    shutil.copytree(other, tok)
    shards_before = sorted(p.name for p in (adir / "shards").iterdir())
    with pytest.raises(SourceError, match=rf"tokenizer {tok} changed since the plan was made"):
        array.tokenize_slice(adir, 1)
    assert sorted(p.name for p in (adir / "shards").iterdir()) == shards_before
    shutil.rmtree(tok)  # the plan's tokenizer back: slice 1 goes through; changed again before the merge
    shutil.copytree(corpus["tok"], tok)
    array.tokenize_slice(adir, 1)
    shutil.rmtree(tok)
    shutil.copytree(other, tok)
    with pytest.raises(SourceError, match="changed since the plan was made"):
        array.merge(adir)
    assert not (tmp_path / "out").exists()


def test_a_merge_stopped_before_or_after_its_move_loses_nothing(corpus, tmp_path, monkeypatch):
    """Stopped before the move (here: in the verification), every shard stays finished for the tasks and
    the next merge goes through; stopped after it, the next merge finishes it. An earlier dataset at the
    output is replaced only then (and only with overwrite: a plan onto another dataset is refused)."""
    import json

    from data_pipeline.output_dir import OutputDirError

    out = tmp_path / "out"
    prepare_dataset(corpus["inputs"][:1], out, corpus["tok"], name="old", shard_bytes=SHARD, progress=False)
    old_name = lambda: json.loads((out / "index.json").read_text())["name"]  # noqa: E731
    n_old = json.loads((out / "index.json").read_text())["num_samples"]
    # fbt data prepare's dataset may hold these inputs: named by its writer, not called one of other inputs
    with pytest.raises(OutputDirError, match=rf"^--out {out} holds a dataset fbt data prepare wrote \({n_old} "
                                             r"documents of 'old'; train on it as it is if it holds these inputs\): "
                                             "nothing was changed; pass --overwrite"):
        array.write_plan(corpus["inputs"], out, corpus["tok"], 2, name="corpus", shard_bytes=SHARD)
    assert not array.array_dir(out.resolve()).exists()
    adir = _planned_and_tokenized(corpus, out, corpus["tok"], overwrite=True)
    real_verify, real_drop = array._verify, array.drop_shard_meta

    def stopped(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(array, "_verify", stopped)
    with pytest.raises(KeyboardInterrupt):
        array.merge(adir)
    monkeypatch.setattr(array, "_verify", real_verify)
    assert old_name() == "old"
    shards = sorted((p.name, p.stat().st_mtime_ns) for p in (adir / "shards").glob("shard-*.tar"))
    for i in range(2):  # the tasks again: each finds its slice finished, nothing rewritten
        assert array.tokenize_slice(adir, i) == array._read_json(adir / "done" / f"slice-{i:05d}.json")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (adir / "shards").glob("shard-*.tar")) == shards
    monkeypatch.setattr(array, "drop_shard_meta", stopped)  # after the move
    with pytest.raises(KeyboardInterrupt):
        array.merge(adir)
    monkeypatch.setattr(array, "drop_shard_meta", real_drop)
    assert not (adir / "shards").exists() and (out / "index.json").is_file()
    index = array.merge(adir)
    assert index["prepare"]["plan"] == array.load_plan(adir)["id"]
    assert old_name() == "corpus" and not list(tmp_path.glob(".out.replaced-*"))
    assert not list(out.glob("*.meta*")) and (adir / array.MERGED_FILE).is_file()
    assert_same_stream(out, corpus["ref"], corpus["tok"])
    # the array's dataset: another plan's is one of other inputs; fbt data prepare names the array as its writer
    with pytest.raises(OutputDirError, match=rf"^--out {out} holds a dataset of other inputs or settings "
                                             rf"\({index['num_samples']} documents of 'corpus'\): nothing was changed"):
        array.write_plan(corpus["inputs"][:1], out, corpus["tok"], 2, name="corpus", shard_bytes=SHARD)
    with pytest.raises(OutputDirError, match=rf"^--out {out} holds a dataset fbt slurm submit-prepare's job array "
                                             rf"wrote \({index['num_samples']} documents of 'corpus'; train on it"):
        prepare_dataset(corpus["inputs"], out, corpus["tok"], name="corpus", shard_bytes=SHARD, progress=False)


def test_merge_names_a_missing_count(corpus, tmp_path):
    adir = _planned_and_tokenized(corpus, tmp_path / "out", corpus["tok"])
    (adir / "counts" / "slice-00001.json").unlink()
    with pytest.raises(SourceError, match=r"slice 1 has not been counted"):
        array.merge(adir)


def test_merge_refuses_a_slice_record_whose_samples_do_not_follow_on(corpus, tmp_path):
    """A done record whose shard starts at another sample than the shards before it end at (a record
    edited or from another run) is refused by the merge, naming the shard and both sample ids."""
    import json

    adir = _planned_and_tokenized(corpus, tmp_path / "out", corpus["tok"])
    record = array._slice_file(adir, "done", 1)
    rec = json.loads(record.read_text())
    info = rec["infos"][0]
    k, want = info["shard"], info["first_sample"]
    info["first_sample"] = want + 1
    record.write_text(json.dumps(rec))
    with pytest.raises(SourceError, match=rf"shard-{k:06d}\.tar is shard {k} from sample {want + 1}, expected shard "
                                          rf"{k} from {want}: run the tasks again"):
        array.merge(adir)
    assert not (tmp_path / "out").exists()


def test_a_corpus_of_empty_documents_is_refused_by_the_merge_counting_them(corpus, tmp_path):
    """Every document empty: the merge says the source is empty and how many empty ones it skipped, as
    fbt data prepare does (EmptySourceError), and writes no dataset."""
    from data_pipeline.errors import EmptySourceError

    raw = tmp_path / "empty.jsonl"
    raw.write_text("".join('{"id": %d, "text": ""}\n' % i for i in range(5)))
    adir, _, _ = array.write_plan([str(raw)], tmp_path / "out", corpus["tok"], 2, name="blank", shard_bytes=SHARD)
    for stage in (array.count_slice, array.tokenize_slice):
        for i in range(2):
            stage(adir, i)
    with pytest.raises(EmptySourceError, match=rf"^source 'blank' is empty: no non-empty documents in {raw} "
                                               r"\(5 empty skipped\)$"):
        array.merge(adir)
    assert not (tmp_path / "out").exists()
