"""Building: tokenizer, shard writer (WebDataset format, index, parallel = serial), embedded mix, CLI."""

from __future__ import annotations

import json
import re
import shutil
import sys

import numpy as np
import pytest
import webdataset as wds
import yaml

from data_pipeline import cli, embedded
from data_pipeline.config import DataConfig
from data_pipeline.embedded import math_documents
from data_pipeline.loader import build_loader
from data_pipeline.prepare import prepare_dataset
from data_pipeline.shards import Dataset, verify_dataset
from data_pipeline.tokenizer import load_tokenizer, tokenizer_hash
from tests.support.data_fixtures import build_fixture


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return build_fixture(tmp_path_factory.mktemp("build"))


def test_tokenizer_roundtrip_byte_fallback_and_hash(fx, tmp_path):
    sp = load_tokenizer(fx["tokenizer"])
    text = "def f(x):\n\treturn 12345 + x  # naïve ✓\n"
    assert sp.decode(sp.encode(text)) == text  # whitespace, tabs, newlines and unseen chars survive
    assert sp.vocab_size() == 320 and sp.eos_id() == 2
    idx = json.loads((fx["root"] / "math" / "index.json").read_text())
    assert idx["tokenizer_hash"] == tokenizer_hash(fx["tokenizer"])
    # `fbt data tokenizer --load` validates and copies an existing model, same identity
    assert cli.main(["tokenizer", "--load", fx["tokenizer"], "--out", str(tmp_path / "copy.model")]) == 0
    assert tokenizer_hash(tmp_path / "copy.model") == tokenizer_hash(fx["tokenizer"])


def test_a_vocabulary_smaller_than_the_texts_characters_is_one_sentence(tmp_path, capsys):
    """sentencepiece's own RuntimeError (required characters over the vocabulary) as the flag to change."""
    corpus = tmp_path / "text.txt"
    corpus.write_text("".join(chr(c) for c in range(0x4E00, 0x4E00 + 400)) * 3 + "\n")
    assert cli.main(["tokenizer", "--input", str(corpus), "--out", str(tmp_path / "t.model"), "--vocab-size", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert "error: --vocab-size 64 is smaller than the " in err and "raise --vocab-size to at least " in err
    assert "Traceback" not in err and not (tmp_path / "t.model").exists()


def test_cli_trains_unigram_tokenizer(fx, tmp_path, capsys):
    out = tmp_path / "u.model"
    rc = cli.main(["tokenizer", "--input", str(fx["root"] / "raw" / "web.jsonl"), str(fx["root"] / "raw" / "code"),
                   "--out", str(out), "--vocab-size", "350", "--model-type", "unigram"])
    assert rc == 0
    info = json.loads(capsys.readouterr().out)
    assert info["hash"] == tokenizer_hash(out) and info["vocab_size"] == 350


def test_shards_are_webdataset_samples_with_tokens_source_and_id(fx):
    sp = load_tokenizer(fx["tokenizer"])
    ds = Dataset.load(fx["root"] / "web")
    assert len(ds.shards) > 3
    urls = [str(fx["root"] / "web" / s["file"]) for s in ds.shards]
    samples = list(wds.WebDataset(urls, shardshuffle=False).decode())
    assert len(samples) == ds.index["num_samples"] == len(fx["docs"]["web"])
    for i, (s, (doc_id, text)) in enumerate(zip(samples, fx["docs"]["web"])):
        assert s["__key__"] == f"{i:010d}"
        assert s["json"]["source"] == "web" and s["json"]["doc_id"] == doc_id
        assert s["tokens.npy"].tolist() == sp.encode(text)
        assert ds.lengths[i] == len(s["tokens.npy"])
    # per-shard bookkeeping: samples and tokens per shard add up; first_sample maps a position to a shard
    assert sum(s["num_samples"] for s in ds.shards) == ds.index["num_samples"]
    assert sum(s["num_tokens"] for s in ds.shards) == ds.index["num_tokens"] == int(ds.lengths.sum())
    firsts = [s["first_sample"] for s in ds.shards]
    assert firsts == list(np.cumsum([0] + [s["num_samples"] for s in ds.shards[:-1]]))
    assert verify_dataset(fx["root"] / "web")["samples"] == ds.index["num_samples"]


def test_parallel_prepare_equals_serial(fx, tmp_path):
    inputs = [str(fx["root"] / "raw" / "code")]
    a = prepare_dataset(inputs, tmp_path / "a", fx["tokenizer"], name="code", shard_bytes=20000, num_workers=1, progress=False)
    b = prepare_dataset(inputs, tmp_path / "b", fx["tokenizer"], name="code", shard_bytes=20000, num_workers=2, progress=False)
    assert a["num_shards"] == b["num_shards"] > 1
    for s in Dataset.load(tmp_path / "a").shards:
        assert (tmp_path / "a" / s["file"]).read_bytes() == (tmp_path / "b" / s["file"]).read_bytes()
    for f in ("lengths.npy", "offsets.npy", "crc32.npy", "shards.npy"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_math_generator_answers_are_correct():
    checked = 0
    for _, text in math_documents(300, seed=1):
        for block in text.split("\n\n"):
            ans = int(re.search(r"#### (-?\d+)", block).group(1))
            if m := re.match(r"Question: What is (\d+) ([-+/]) (\d+)\?", block):
                a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
                assert ans == {"+": a + b, "-": a - b, "/": a // b}[op]
                checked += 1
            elif m := re.match(r"Question: Compute (\d+) \* (\d+)\.", block):
                assert ans == int(m.group(1)) * int(m.group(2))
                checked += 1
            elif m := re.match(r"Question: Solve for x: (\d+)x \+ (\d+) = (-?\d+)\.", block):
                assert int(m.group(1)) * ans + int(m.group(2)) == int(m.group(3))
                checked += 1
    assert checked > 100
    assert list(math_documents(5, seed=1)) == list(math_documents(5, seed=1))


def test_embedded_build_small_is_usable_and_idempotent(tmp_path, capsys, monkeypatch):
    out = tmp_path / "emb"
    args = ["embedded", "--out", str(out), "--vocab-size", "512", "--code-mb", "0.3", "--prose-mb", "0.3",
            "--math-docs", "400", "--workers", "2", "--seq-length", "64", "--quiet"]
    assert cli.main(args) == 0
    printed = yaml.safe_load(capsys.readouterr().out)["data"]
    mix = yaml.safe_load((out / "mix.yaml").read_text())["data"]
    assert printed == mix
    cfg = DataConfig(**mix)
    assert [s.name for s in cfg.sources] == ["code", "prose", "math"]
    for s in cfg.sources:
        idx = json.loads((out / s.name / "index.json").read_text())
        assert idx["num_tokens"] > 10_000 and idx["tokenizer_hash"] == tokenizer_hash(out / "tokenizer.model")
    stdlib_doc = json.loads((out / "code" / "index.json").read_text())
    assert stdlib_doc["num_samples"] > 5
    ld = build_loader(cfg, micro_batch_size=4, global_batch_size=8, dp_rank=0, dp_size=1)
    b = next(ld)
    assert b["input_ids"].shape == (4, 64) and int(b["input_ids"].max()) < 512
    # second run: same settings -> skipped, nothing rewritten
    stamp = (out / "embedded.json").stat().st_mtime_ns
    shard = (out / "math" / "shard-000000.tar").stat().st_mtime_ns
    assert cli.main(args) == 0
    captured = capsys.readouterr()
    assert "skipping" in captured.err and yaml.safe_load(captured.out)["data"] == mix
    assert (out / "embedded.json").stat().st_mtime_ns == stamp
    assert (out / "math" / "shard-000000.tar").stat().st_mtime_ns == shard
    # a copied build: the section and mix.yaml name the copy's files (its other keys and comments kept),
    # the original is left as it was; the section and mix.yaml have the asked sequence length, said
    def embedded_at(where, *extra):
        assert cli.main([*args[:2], str(where), *args[3:], *extra]) == 0
        captured = capsys.readouterr()
        return captured.err, yaml.safe_load(captured.out)["data"]

    def names(section, where):
        return [section["tokenizer"], *(s["path"] for s in section["sources"])] == \
            [str(where / n) for n in ("tokenizer.model", "code", "prose", "math")]

    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    original_mix = (out / "mix.yaml").read_text()
    (copy / "mix.yaml").write_text(original_mix + "note: kept\n")
    (copy / "mix.yaml").chmod(0o644)
    err, printed = embedded_at(copy, "--seq-length", "32")
    assert "skipping" in err and f"named the files in {out}" in err and "copied or moved" in err
    assert f"{copy / 'mix.yaml'} had seq_length 64; it now has seq_length 32 (as asked)" in err
    assert names(printed, copy) and printed["seq_length"] == 32
    copied_mix = yaml.safe_load((copy / "mix.yaml").read_text())
    assert names(copied_mix["data"], copy.resolve()) and copied_mix["note"] == "kept"
    assert {k: v for k, v in copied_mix["data"].items() if k not in ("tokenizer", "sources")} == \
        {k: v for k, v in mix.items() if k not in ("tokenizer", "sources")} | {"seq_length": 32}
    assert {k: v for k, v in copied_mix["data"].items() if k not in ("tokenizer", "sources")} == \
        {k: v for k, v in printed.items() if k not in ("tokenizer", "sources")}
    assert (copy / "mix.yaml").read_text().startswith("# Embedded default token mix")
    assert (copy / "mix.yaml").stat().st_mode & 0o777 == 0o644
    assert (out / "mix.yaml").read_text() == original_mix and sorted(copy.glob(".mix.yaml*")) == []
    err = embedded_at(copy)[0]
    assert "copied or moved" not in err  # now at home: only the sequence length asked
    assert "seq_length 32; it now has seq_length 64" in err
    assert "now has" not in embedded_at(copy)[0]  # as asked already: nothing rewritten
    edited = (copy / "mix.yaml").read_text().replace("seq_length: 64", "seq_length: 512  # mine")
    (copy / "mix.yaml").write_text(edited)
    assert cli.main(["embedded", "--out", str(copy), *args[3:args.index("--seq-length")], "--quiet"]) == 0
    captured = capsys.readouterr()  # no --seq-length: the file's own is kept and printed
    assert yaml.safe_load(captured.out)["data"]["seq_length"] == 512 and (copy / "mix.yaml").read_text() == edited
    # moved, the folder it names gone: the moved mix.yaml is what a loader reads
    moved = tmp_path / "moved"
    shutil.move(copy, moved)
    assert cli.main(["peek", str(moved / "mix.yaml")]) == 2  # before fbt data embedded points it here: the fix
    assert capsys.readouterr().err.strip().endswith(
        f"{moved / 'mix.yaml'} names the files of the embedded build at {copy.resolve()}, which are not there: "
        f"run fbt data embedded --out {moved} to point it at this build's own")
    err, printed = embedded_at(moved)
    assert f"named the files in {copy.resolve()}" in err and names(printed, moved)
    moved_mix = DataConfig(**yaml.safe_load((moved / "mix.yaml").read_text())["data"])
    assert next(build_loader(moved_mix, micro_batch_size=4, global_batch_size=4, dp_rank=0, dp_size=1))[
        "input_ids"].shape == (4, 64)
    # a folder it cannot write: said, left as it was, the section printed
    at_home = (moved / "mix.yaml").read_text()
    elsewhere = at_home.replace(str(moved.resolve()), "/elsewhere/emb")
    (moved / "mix.yaml").write_text(elsewhere)
    with monkeypatch.context() as m:
        m.setattr(embedded.os, "replace", lambda *a: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
        err, printed = embedded_at(moved)
    assert f"could not point {moved / 'mix.yaml'} at {moved.resolve()} (Permission denied)" in err and names(printed, moved)
    assert (moved / "mix.yaml").read_text() == elsewhere and sorted(moved.glob(".mix.yaml*")) == []
    (moved / "mix.yaml").write_text(at_home)
    # paths a user changed, relative paths, a file that does not parse: left as they are
    for text in (at_home.replace(str(moved.resolve() / "code"), "/datasets/mycode"),
                 at_home.replace(str(moved.resolve()), "data/embedded").replace(str(out), "data/embedded"),
                 original_mix.replace("data:", "data: [", 1), "\xff not UTF-8", "data: {sources: 5}\n",
                 "data: {tokenizer: /x/tokenizer.model, sources: [{name: [code], path: /x/code}]}\n"):
        assert text != at_home
        (moved / "mix.yaml").write_text(text, encoding="latin-1")
        err, printed = embedded_at(moved)
        assert (moved / "mix.yaml").read_text(encoding="latin-1") == text and names(printed, moved), text
        assert "copied or moved" not in err
    # a build from another Python's standard library: kept as it is (a run may be reading it), said so
    built = json.loads((out / "embedded.json").read_text())
    built["settings"].update(python="3.99.0", stdlib="/elsewhere/lib/python3.99")
    (out / "embedded.json").write_text(json.dumps(built))
    assert cli.main(args) == 0
    captured = capsys.readouterr()
    assert "built from Python 3.99.0's standard library" in captured.err and "--force" in captured.err
    assert yaml.safe_load(captured.out)["data"] == mix
    assert (out / "math" / "shard-000000.tar").stat().st_mtime_ns == shard
    assert json.loads((out / "embedded.json").read_text())["settings"]["python"] == "3.99.0"
    # --force: rebuilt from this Python's standard library
    assert cli.main(args + ["--force"]) == 0
    assert "training tokenizer" in capsys.readouterr().err
    assert json.loads((out / "embedded.json").read_text())["settings"]["python"] == sys.version.split()[0]
    # other settings (not only the Python), or a stamp this project did not finish: rebuilt
    for stamp in [{**built, "settings": {**built["settings"], "math_docs": 399}}, {"settings": "x"},
                  {"settings": [1]}, [1], "{not json", {"building": built["settings"]}]:
        (out / "embedded.json").write_text(stamp if isinstance(stamp, str) else json.dumps(stamp))
        assert cli.main(args) == 0, stamp
        assert "training tokenizer" in capsys.readouterr().err, stamp
        assert json.loads((out / "embedded.json").read_text())["settings"]["python"] == sys.version.split()[0]


def test_cli_inspect_and_peek(fx, tmp_path, capsys):
    assert cli.main(["inspect", str(fx["root"] / "math"), "--verify"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["samples"] == 200 and info["verified"]["tokens"] == info["tokens"]
    recipe = tmp_path / "mix.yaml"
    recipe.write_text(yaml.safe_dump({"data": {
        "tokenizer": fx["tokenizer"], "seq_length": 48,
        "sources": [{"name": "math", "path": str(fx["root"] / "math"), "weight": 1.0}]}}))
    assert cli.main(["peek", str(recipe), "--sequences", "1"]) == 0
    assert "Question: what is" in capsys.readouterr().out
    assert cli.main(["peek", str(recipe), "--sequences", "1", "--split", "valid"]) == 0
    out = capsys.readouterr().out
    assert "--- valid sequence 0" in out and "Question: what is" in out

    # a training recipe: its data.pipeline is the stream (before: a pydantic traceback); synthetic data has none
    training = tmp_path / "train.yaml"
    training.write_text(yaml.safe_dump({"data": {"source": "pipeline", "seq_length": 48, "pipeline": {
        "tokenizer": fx["tokenizer"], "sources": [{"name": "math", "path": str(fx["root"] / "math"), "weight": 1.0}]}}}))
    assert cli.main(["peek", str(training), "--sequences", "1"]) == 0
    assert "Question: what is" in capsys.readouterr().out
    from data_pipeline.cli import _peek_config

    training.write_text(yaml.safe_dump({"data": {"source": "pipeline", "seq_length": 16, "seed": 7, "pipeline": {
        "tokenizer": fx["tokenizer"], "sources": [{"name": "math", "path": str(fx["root"] / "math"), "weight": 1.0}]}}}))
    assert (_peek_config(training).seq_length, _peek_config(training).seed) == (16, 7)  # as fbt train reads it
    (tmp_path / "emb").mkdir()
    (tmp_path / "emb" / "mix.yaml").write_text(recipe.read_text())
    training.write_text(yaml.safe_dump({"data": {"source": "pipeline", "seq_length": 24, "seed": 5,
                                                 "embedded_dir": str(tmp_path / "emb")}}))
    assert (_peek_config(training).seq_length, _peek_config(training).seed) == (24, 5)
    training.write_text(yaml.safe_dump({"data": {"source": "pipeline", "embedded_dir": str(tmp_path / "none")}}))
    assert cli.main(["peek", str(training)]) == 2
    assert capsys.readouterr().err.strip().endswith(f"run fbt data embedded --out {tmp_path / 'none'}")
    training.write_text(yaml.safe_dump({"data": {"source": "synthetic"}}))
    assert cli.main(["peek", str(training)]) == 2
    assert capsys.readouterr().err.strip().endswith(
        f"{training} trains on synthetic data (data.source: synthetic): there is no stream to peek")
    for text, said in (("data: {tokenizer: t}\n", "is neither a mix.yaml nor a recipe with data.pipeline: sources: "
                                                   "Field required"),
                       ("# notes\nnot: [yaml\n", "is not YAML (line 3, column 1): give a mix.yaml or a recipe")):
        training.write_text(text)
        assert cli.main(["peek", str(training)]) == 2
        assert capsys.readouterr().err.strip().endswith(f"{training} {said}"), text
