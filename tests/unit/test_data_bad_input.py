"""Bad input: each gives a clear error naming the file, or (when allowed) a logged, counted skip."""

from __future__ import annotations

import json
import shutil
import tarfile

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from data_pipeline import cli
from data_pipeline.config import DataConfig
from data_pipeline.errors import CorruptShardError, IndexError_, SourceError, TokenizerMismatchError
from data_pipeline.loader import build_loader, planner_for
from data_pipeline.prepare import prepare_dataset
from data_pipeline.shards import Dataset, sample_key, verify_dataset
from data_pipeline.tokenizer import train_tokenizer
from tests.support.data_fixtures import build_fixture, fixture_config

S, MB, GB = 32, 2, 8

DOCUMENTS = ("cu_seqlens", "max_seqlen")  # per micro-batch, not [B, S]: not concatenated


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return build_fixture(tmp_path_factory.mktemp("clean"))


@pytest.fixture
def fx(clean, tmp_path):
    """A private copy of the prepared fixture, safe to damage."""
    root = tmp_path / "fx"
    shutil.copytree(clean["root"], root)
    return {"root": root, "docs": clean["docs"], "tokenizer": str(root / "tok.model")}


def stream(cfg, steps):
    ld = build_loader(cfg, micro_batch_size=MB, global_batch_size=GB, dp_rank=0, dp_size=1)
    out = [next(ld) for _ in range(steps * ld.micro_batches_per_step)]
    return {k: torch.cat([b[k] for b in out]) for k in out[0] if k not in DOCUMENTS}, ld


def first_math_sample(fx, cfg):
    """The math sample the stream reaches first, and the shard file holding it."""
    ds = Dataset.load(fx["root"] / "math")
    src, sid = planner_for(cfg).documents(50)  # the train split build_loader reads
    target = int(sid[np.flatnonzero(src == 2)[0]])
    shard = ds.shards[ds.shard_of(target)]
    return target, fx["root"] / "math" / shard["file"]


def flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_truncated_shard_is_named_when_reached(fx):
    """No per-shard stat at start-up: a shard's size is checked against the index when it is opened."""
    cfg = fixture_config(fx)
    shard = fx["root"] / "code" / "shard-000002.tar"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    ld = build_loader(cfg, micro_batch_size=MB, global_batch_size=GB, dp_rank=0, dp_size=1)
    with pytest.raises(CorruptShardError, match=r"code/shard-000002\.tar: size \d+ bytes, index records \d+ \(truncated"):
        for _ in range(500):
            next(ld)
    with pytest.raises(CorruptShardError, match=r"shard-000002\.tar"):
        verify_dataset(fx["root"] / "code")


def test_missing_shard_is_named_at_build(fx):
    (fx["root"] / "web" / "shard-000001.tar").unlink()
    with pytest.raises(CorruptShardError, match=r"web/shard-000001\.tar: missing"):
        build_loader(fixture_config(fx), micro_batch_size=MB, global_batch_size=GB, dp_rank=0, dp_size=1)


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_bad_shard_skipped_when_allowed_is_masked_counted_and_keeps_positions(fx, clean, damage):
    """With allow_skip_corrupt a bad shard's documents keep their places in the stream as loss-masked
    spans: the stream (and so every resume cursor) does not depend on which shards are readable."""
    shard_file = fx["root"] / "code" / "shard-000002.tar"
    if damage == "truncate":
        shard_file.write_bytes(shard_file.read_bytes()[:1000])
    else:
        shard_file.unlink()
    cfg = fixture_config(fx, allow_skip_corrupt=True)
    ds = Dataset.load(fx["root"] / "code", allow_skip_corrupt=True)
    src, sid = planner_for(cfg).documents(3000)
    dss = [Dataset.load(s_.path, allow_skip_corrupt=True) for s_ in cfg.sources]
    lens = np.array([int(dss[i].lengths[k]) + 1 for i, k in zip(src, sid)])
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    lo, hi = int(ds.shard_table[2, 0]), ds.shard_end(2)
    bad = (src == 1) & (sid >= lo) & (sid < hi)
    steps = int(starts[np.flatnonzero(bad)[1]]) // (GB * S) + 2  # reach two documents of the bad shard
    ref, _ = stream(fixture_config(clean), steps)
    got, ld = stream(cfg, steps)
    assert ld.stats["skipped_shards"] == 1
    assert ld.stats["skipped_shard_samples"] == int(ds.shard_table[2, 1]) > 0
    assert ld.stats["skipped_corrupt_samples"] == 0  # documents of a bad shard are not counted twice
    assert torch.equal(ref["doc_start"], got["doc_start"])  # same positions
    # exactly the bad shard's documents' token spans are newly masked (and hold EOS filler)
    n = got["input_ids"].numel()
    want = np.zeros(n, bool)
    for j in np.flatnonzero(bad):
        want[starts[j]:min(n, starts[j] + lens[j] - 1)] = True
    newly = ((got["loss_mask"] == 0) & (ref["loss_mask"] == 1)).reshape(-1).numpy()
    assert want.sum() > 0 and np.array_equal(newly, want)
    assert np.array_equal((ref["input_ids"] != got["input_ids"]).reshape(-1).numpy(), want)
    assert np.array_equal(ref["input_ids"].reshape(-1).numpy()[~want], got["input_ids"].reshape(-1).numpy()[~want])


def test_corrupt_token_bytes_raise_when_reached(fx):
    cfg = fixture_config(fx)
    target, shard = first_math_sample(fx, cfg)
    with tarfile.open(shard) as tf:
        m = tf.getmember(f"{sample_key(target)}.tokens.npy")
    flip(shard, m.offset_data + 130)  # inside the token data (npy header is 128 bytes)
    ld = build_loader(cfg, micro_batch_size=MB, global_batch_size=GB, dp_rank=0, dp_size=1)  # size unchanged
    with pytest.raises(CorruptShardError, match=rf"math/{shard.name}: sample {target} .*crc32"):
        for _ in range(200):
            next(ld)


def test_corrupt_tar_header_raises_naming_the_shard(fx):
    cfg = fixture_config(fx)
    target, shard = first_math_sample(fx, cfg)
    ds = Dataset.load(fx["root"] / "math")
    flip(shard, int(ds.offsets[target]) + 3)  # the member name in the tar header: checksum fails
    ld = build_loader(cfg, micro_batch_size=MB, global_batch_size=GB, dp_rank=0, dp_size=1)
    with pytest.raises(CorruptShardError, match=rf"math/{shard.name}: sample {target}"):
        for _ in range(200):
            next(ld)


def test_corrupt_sample_skipped_when_allowed_is_masked_and_counted(fx, clean, caplog):
    cfg = fixture_config(fx, allow_skip_corrupt=True)
    target, shard = first_math_sample(fx, cfg)
    with tarfile.open(shard) as tf:
        m = tf.getmember(f"{sample_key(target)}.tokens.npy")
    flip(shard, m.offset_data + 130)
    ref, _ = stream(fixture_config(clean), 30)
    got, ld = stream(cfg, 30)
    assert ld.stats["skipped_corrupt_samples"] == 1
    assert "corrupt shard" in caplog.text and shard.name in caplog.text
    # the stream keeps its positions: only the bad document's span differs, and it is loss-masked
    differ = ref["input_ids"] != got["input_ids"]
    assert differ.any()
    assert (got["loss_mask"][differ] == 0).all()
    assert torch.equal(ref["doc_start"], got["doc_start"])
    n_masked = int(((got["loss_mask"] == 0) & (ref["loss_mask"] == 1)).sum())
    assert n_masked == Dataset.load(fx["root"] / "math").lengths[target]  # exactly the document's tokens


def test_a_corrupt_short_document_early_in_a_micro_batch_masks_only_its_span(fx, clean):
    """The skipped span is the document's own tokens wherever it falls: here a short document that
    starts within its own length of a micro-batch's first token (the loss of the documents after it,
    in the same micro-batch, is kept)."""
    cfg = fixture_config(fx, allow_skip_corrupt=True)
    dss = [Dataset.load(s_.path) for s_ in cfg.sources]
    src, sid = planner_for(cfg).documents(3000)
    lens = np.array([int(dss[i].lengths[k]) + 1 for i, k in zip(src, sid)])  # + the EOS after each
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    window = MB * S
    first = {}
    for j, (i, k) in enumerate(zip(src, sid)):
        first.setdefault((int(i), int(k)), j)
    j = next(j for j in range(len(src)) if first[(int(src[j]), int(sid[j]))] == j
             and 3 <= lens[j] < window // 2 and starts[j] % window < lens[j] - 1 and starts[j] > window)
    source, target = int(src[j]), int(sid[j])
    shard = fx["root"] / cfg.sources[source].name / dss[source].shards[dss[source].shard_of(target)]["file"]
    with tarfile.open(shard) as tf:
        m = tf.getmember(f"{sample_key(target)}.tokens.npy")
    flip(shard, m.offset_data + 129)  # a token's byte (the npy header is 128 bytes)
    steps = int(starts[j]) // (GB * S) + 2
    ref, _ = stream(fixture_config(clean), steps)
    got, ld = stream(cfg, steps)
    assert ld.stats["skipped_corrupt_samples"] == 1
    n = got["input_ids"].numel()
    want = np.zeros(n, bool)
    for jj in np.flatnonzero((src == source) & (sid == target)):
        want[starts[jj]:min(n, starts[jj] + lens[jj] - 1)] = True
    newly = ((got["loss_mask"] == 0) & (ref["loss_mask"] == 1)).reshape(-1).numpy()
    assert want.sum() > 0 and np.array_equal(newly, want)


def test_tokenizer_mismatch_names_the_index(fx, tmp_path):
    other = tmp_path / "other.model"
    train_tokenizer([t for v in fx["docs"].values() for _, t in v], other, vocab_size=360, num_threads=1)
    cfg = fixture_config(fx).model_copy(update={"tokenizer": str(other)})
    with pytest.raises(TokenizerMismatchError, match=r"web/index\.json was built with tokenizer"):
        build_loader(cfg, micro_batch_size=MB, global_batch_size=GB, dp_rank=0, dp_size=1)
    # a loader state made with another tokenizer is refused too
    ld = build_loader(fixture_config(fx), micro_batch_size=MB, global_batch_size=GB, dp_rank=0, dp_size=1)
    st = dict(ld.state_dict(), tokenizer_hash="0123456789abcdef")
    with pytest.raises(TokenizerMismatchError, match="loader state"):
        build_loader(fixture_config(fx), micro_batch_size=MB, global_batch_size=GB, dp_rank=0, dp_size=1, state=st)


def test_missing_dataset_dir_and_tokenizer_are_named(fx):
    cfg = fixture_config(fx)
    bad = cfg.model_copy(update={"sources": [cfg.sources[0].model_copy(update={"path": str(fx["root"] / "nope")})]})
    with pytest.raises(IndexError_, match=r"nope"):
        build_loader(bad, micro_batch_size=MB, global_batch_size=GB, dp_rank=0, dp_size=1)
    (fx["root"] / "web" / "index.json").unlink()
    with pytest.raises(IndexError_, match=r"web/index\.json"):
        build_loader(cfg, micro_batch_size=MB, global_batch_size=GB, dp_rank=0, dp_size=1)
    with pytest.raises(TokenizerMismatchError, match="missing.model"):
        build_loader(cfg.model_copy(update={"tokenizer": "missing.model"}), micro_batch_size=MB,
                     global_batch_size=GB, dp_rank=0, dp_size=1)


def test_missing_source_path_is_named(fx, tmp_path, capsys):
    missing = tmp_path / "no_such_dir"
    with pytest.raises(SourceError, match=str(missing)):
        prepare_dataset([str(missing)], tmp_path / "out", fx["tokenizer"], progress=False)
    rc = cli.main(["prepare", "--input", str(missing), "--tokenizer", fx["tokenizer"], "--out",
                   str(tmp_path / "out"), "--quiet"])
    assert rc == 2 and str(missing) in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_empty_source_is_an_error_and_empty_documents_are_counted(fx, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    (tmp_path / "empty" / "b.txt").write_text("  \n")
    with pytest.raises(SourceError, match=r"'e' is empty.*empty.*2 empty skipped"):
        prepare_dataset([str(tmp_path / "empty")], tmp_path / "e", fx["tokenizer"], progress=False)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(SourceError, match="no readable files"):
        prepare_dataset([str(tmp_path / "nothing")], tmp_path / "n", fx["tokenizer"], progress=False)
    blank = tmp_path / "blank.jsonl"
    blank.write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(SourceError, match="is empty"):
        prepare_dataset([str(blank)], tmp_path / "b", fx["tokenizer"], progress=False)
    # the fixture's web source had one empty record: recorded in the index, not silently lost
    assert json.loads((fx["root"] / "web" / "index.json").read_text())["skipped_empty_documents"] == 1


def test_bad_jsonl_names_file_and_line(fx, tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    with pytest.raises(SourceError, match=r"bad\.jsonl:2: invalid JSON"):
        prepare_dataset([str(p)], tmp_path / "o", fx["tokenizer"], progress=False)
    p.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(SourceError, match=r"bad\.jsonl:1: record has no text field 'text'"):
        prepare_dataset([str(p)], tmp_path / "o", fx["tokenizer"], progress=False)


def test_config_errors_name_the_field():
    base = {"sources": [{"name": "a", "path": "p", "weight": 1.0}], "tokenizer": "t.model", "seq_length": 8}
    with pytest.raises(ValidationError, match=r"sources\.0\.weight"):
        DataConfig(**{**base, "sources": [{"name": "a", "path": "p", "weight": 0}]})
    with pytest.raises(ValidationError, match="bogus"):
        DataConfig(**{**base, "bogus": 1})
    with pytest.raises(ValidationError, match=r"sources\.0\.extra"):
        DataConfig(**{**base, "sources": [{"name": "a", "path": "p", "weight": 1, "extra": 2}]})
    with pytest.raises(ValidationError, match="seq_length"):
        DataConfig(**{k: v for k, v in base.items() if k != "seq_length"})
    with pytest.raises(ValidationError, match="unique"):
        DataConfig(**{**base, "sources": base["sources"] * 2})
    assert DataConfig(**base).seed == 0 and DataConfig(**base).num_workers == 0
