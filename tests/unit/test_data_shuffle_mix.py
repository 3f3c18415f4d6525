"""Document shuffling, token-share mixing, memory-mapped indexes and their format versions."""

from __future__ import annotations

import io
import json
import pickle
import tarfile

import numpy as np
import pytest
import webdataset as wds

from data_pipeline.errors import DataError, IndexError_
from data_pipeline.loader import build_loader, planner_for
from data_pipeline.shards import Dataset, verify_dataset
from data_pipeline.stream import BLOCK, FeistelPermutation
from tests.support.data_fixtures import assert_same_batches as assert_same
from tests.support.data_fixtures import build_fixture, fixture_config, global_stream

S, MB = 32, 2


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return build_fixture(tmp_path_factory.mktemp("shuffle"))


def test_feistel_is_a_seeded_permutation():
    for n in (1, 2, 3, 7, 64, 65, 1000, 4099):
        got = FeistelPermutation(n, [0, 1, 2])(np.arange(n))
        assert sorted(got.tolist()) == list(range(n)), n
    a, b = FeistelPermutation(4099, [0, 1, 2])(np.arange(4099)), FeistelPermutation(4099, [0, 1, 3])(np.arange(4099))
    assert not np.array_equal(a, b)
    # random access: any slice of positions maps like the whole
    assert np.array_equal(FeistelPermutation(4099, [0, 1, 2])(np.arange(1000, 1100)), a[1000:1100])


def test_documents_are_shuffled_within_each_epoch(fx):
    """A source written in sorted order is not read in that order: consecutive documents of a source are
    rarely neighbours on disk, every epoch visits every document once, and epochs differ."""
    cfg = fixture_config(fx)
    planner = planner_for(cfg)
    for i, order in enumerate(planner.orders):
        n = order.n
        e0, e1 = order.sample_ids(np.arange(n)), order.sample_ids(np.arange(n, 2 * n))
        assert sorted(e0.tolist()) == sorted(e1.tolist()) == list(range(n))
        assert not np.array_equal(e0, e1)
        neighbours = np.mean(np.abs(np.diff(e0)) == 1)
        assert neighbours < 0.1, (order.ds.name, neighbours)
        # not shard-contiguous either: a run of 10 documents spans several shards
        shards = {order.ds.shard_of(int(s)) for s in e0[:10]}
        assert len(shards) >= 3, (order.ds.name, shards)


@pytest.mark.parametrize("dp,workers", [(2, 2), (4, 0)])
def test_shuffled_stream_identical_at_dp_and_workers_and_resumes(fx, dp, workers):
    cfg = fixture_config(fx, seq_length=S)
    gb, total, cut = 16, 14, 5
    ref, _ = global_stream(cfg, total, 1, gb=gb, mb=MB)
    # the stream is the shuffled one: documents of a source do not come in stored order
    src, sid = planner_for(cfg).documents(200)
    assert not all(np.all(np.diff(sid[src == i]) > 0) for i in range(3))
    got, _ = global_stream(fixture_config(fx, seq_length=S, num_workers=workers), total, dp, gb=gb, mb=MB)
    assert_same(ref, got)
    # exact resume across a change of DP size and worker count
    _, loaders = global_stream(cfg, cut, dp, gb=gb, mb=MB)
    state = json.loads(json.dumps(loaders[0].state_dict()))
    resumed, _ = global_stream(fixture_config(fx, seq_length=S, num_workers=2 - workers), total - cut, 4 // dp,
                               gb=gb, mb=MB, state=state)  # DP 2 -> 2 with 0 workers, DP 4 -> 1 with 2
    assert_same({k: v[cut * gb:] for k, v in ref.items()}, resumed)


def _token_shares(planner, n_docs):
    src, sid = planner.documents(n_docs)
    lens = np.empty(len(src), np.int64)
    for i, ds in enumerate(planner.datasets):
        lens[src == i] = ds.lengths[sid[src == i]].astype(np.int64) + 1  # stream positions incl. EOS
    return src, np.bincount(src, weights=lens, minlength=len(planner.datasets)) / lens.sum()


@pytest.mark.parametrize("weights", [(0.5, 0.2, 0.3), (0.1, 0.6, 0.3), (0.05, 0.05, 0.9)])
def test_token_share_mixing_within_one_point(fx, weights):
    cfg = fixture_config(fx, weights=weights)  # weight_by: tokens is the default
    assert cfg.weight_by == "tokens"
    planner = planner_for(cfg)
    src, shares = _token_shares(planner, 40 * BLOCK)
    assert np.abs(shares - np.array(weights)).max() < 0.01, shares
    # the document counts are exact per block (to one document per source), for the derived document shares
    for b in range(40):
        counts = np.bincount(src[b * BLOCK:(b + 1) * BLOCK], minlength=3)
        assert np.abs(counts - planner._active_weights * BLOCK).max() < 1.0 + 1e-9
    # and the document shares are not the token shares here (the sources' documents differ in length)
    doc_shares = np.bincount(src, minlength=3) / len(src)
    assert np.abs(doc_shares - np.array(weights)).max() > 0.05
    # weight_by: documents keeps the weights as document shares
    src_d, _ = planner_for(fixture_config(fx, weights=weights, weight_by="documents")).documents(40 * BLOCK)
    assert np.abs(np.bincount(src_d, minlength=3) / len(src_d) - np.array(weights)).max() < 0.01


def test_token_shares_on_the_loaders_batches(fx):
    """Measured on what the loader returns: every complete document of the batches is looked up among
    the sources' documents (by its tokens) and its tokens + EOS counted for that source."""
    from data_pipeline.shards import DatasetReader

    weights = (0.5, 0.2, 0.3)
    cfg = fixture_config(fx, weights=weights, seq_length=256)
    owner = {}
    for i, s in enumerate(cfg.sources):
        ds = Dataset.load(s.path)
        r = DatasetReader(ds)
        for sid in range(ds.num_samples):
            owner.setdefault(r.get(sid).tobytes(), set()).add(i)
    ld = build_loader(cfg, micro_batch_size=16, global_batch_size=16, dp_rank=0, dp_size=1)
    batches = [next(ld) for _ in range(120)]  # ~490k tokens: several epochs of every source
    flat = np.concatenate([b["input_ids"].reshape(-1).numpy() for b in batches])
    starts = np.flatnonzero(np.concatenate([b["doc_start"].reshape(-1).numpy() for b in batches]))
    tokens = np.zeros(3)
    for a, b in zip(starts[:-1], starts[1:]):
        srcs = owner[flat[a:b - 1].astype(np.uint16).tobytes()]
        if len(srcs) == 1:  # (a text present in two sources cannot be attributed)
            tokens[next(iter(srcs))] += b - a
    shares = tokens / tokens.sum()
    assert np.abs(shares - np.array(weights)).max() < 0.01, shares


def test_train_and_valid_loaders_share_the_memory_maps(fx):
    cfg = fixture_config(fx)
    kw = dict(micro_batch_size=MB, global_batch_size=8, dp_rank=0, dp_size=1)
    train, valid = build_loader(cfg, **kw), build_loader(cfg, split="valid", **kw)
    for a, b in zip(train._spec.datasets, valid._spec.datasets):
        assert a is b
        assert isinstance(a.lengths, np.memmap) and isinstance(a.offsets, np.memmap) and isinstance(a.crc32, np.memmap)
    # pickling (a spawned worker) reopens the maps instead of copying the arrays
    ds = train._spec.datasets[0]
    blob = pickle.dumps(ds)
    assert len(blob) < 1000
    assert pickle.loads(blob) is ds  # same process: the shared instance


def _write_v1(ds: Dataset, out):
    """The same documents as a format-1 dataset, written the way format 1 was (pax headers, samples.npz)."""
    out.mkdir()
    from data_pipeline.shards import DatasetReader

    reader = DatasetReader(ds)
    shards, offsets = [], []
    for i in range(ds.num_shards):
        lo, hi = int(ds.shard_table[i, 0]), ds.shard_end(i)
        f = out / f"part-{i:03d}.tar"
        with open(f, "wb") as fh:
            w = wds.TarWriter(fh, mtime=0.0)
            for sid in range(lo, hi):
                buf = io.BytesIO()
                np.save(buf, reader.get(sid))
                w.write({"__key__": f"{sid:010d}", "tokens.npy": buf.getvalue(), "json": b"{}"})
            w.close()
        with tarfile.open(f) as tf:
            first = {}
            for m in tf.getmembers():
                first.setdefault(m.name.split(".")[0], m.offset)
        offsets += [first[f"{sid:010d}"] for sid in range(lo, hi)]
        shards.append({"file": f.name, "first_sample": lo, "num_samples": hi - lo,
                       "num_tokens": int(ds.shard_table[i, 2]), "bytes": f.stat().st_size})
    np.savez(out / "samples.npz", lengths=np.asarray(ds.lengths), offsets=np.asarray(offsets, np.int64),
             crc32=np.asarray(ds.crc32))
    index = {k: v for k, v in ds.index.items() if k not in ("format_version", "num_shards")}
    (out / "index.json").write_text(json.dumps(dict(index, format="fbt-data-v1", shards=shards)))


def test_format_versions_old_read_unknown_refused(fx, tmp_path, caplog):
    ds = Dataset.load(fx["root"] / "math")
    assert ds.index["format"] == "fbt-data" and ds.index["format_version"] == 2
    # version 1 is read (eagerly, with a warning) and gives the same stream
    old = tmp_path / "math"
    _write_v1(ds, old)
    v1 = Dataset.load(old)
    assert v1.version == 1 and "format version 1" in caplog.text
    assert verify_dataset(old)["tokens"] == ds.index["num_tokens"]
    def only_math(path):
        cfg = fixture_config(fx)
        return cfg.model_copy(update={"sources": [cfg.sources[2].model_copy(update={"path": str(path)})]})

    kw = dict(micro_batch_size=MB, global_batch_size=8, dp_rank=0, dp_size=1)
    a, b = build_loader(only_math(fx["root"] / "math"), **kw), build_loader(only_math(old), **kw)
    for _ in range(20):
        assert_same(next(a), next(b))
    # unknown and newer versions are refused, naming the file and the version
    idx = json.loads((old / "index.json").read_text())
    for bad, pattern in ((dict(idx, format="fbt-data", format_version=3), r"index\.json: index format_version 3 .*newer"),
                         (dict(idx, format="something-else"), r"index\.json: not an fbt dataset index .*something-else"),
                         (dict(idx, format="fbt-data", format_version="2"), r"not an fbt dataset index")):
        (old / "index.json").write_text(json.dumps(bad))
        with pytest.raises(IndexError_, match=pattern):
            Dataset.load(old)


def test_loader_state_of_the_unshuffled_stream_is_refused(fx):
    cfg = fixture_config(fx)
    kw = dict(micro_batch_size=MB, global_batch_size=8, dp_rank=0, dp_size=1)
    st = build_loader(cfg, consumed_sequences=16, **kw).state_dict()
    assert st["version"] == 2 and st["weight_by"] == "tokens"
    with pytest.raises(DataError, match="version 1 .*unshuffled"):
        build_loader(cfg, state=dict(st, version=1), **kw)
    with pytest.raises(DataError, match="weight_by"):
        build_loader(fixture_config(fx, weight_by="documents"), state=st, **kw)
