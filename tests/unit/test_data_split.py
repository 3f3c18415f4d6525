"""The held-out validation split: disjoint from training, DP-independent, refused across split settings."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from data_pipeline.errors import DataError
from data_pipeline.loader import build_loader, held_out_documents, planner_for
from data_pipeline.shards import Dataset
from data_pipeline.stream import Planner, auto_valid_documents
from data_pipeline.tokenizer import load_tokenizer
from tests.support.data_fixtures import assert_same_batches as assert_same
from tests.support.data_fixtures import build_fixture, fixture_config, global_stream

S, MB, GB = 32, 2, 8
NAMES = ("web", "code", "math")

DOCUMENTS = ("cu_seqlens", "max_seqlen")  # per micro-batch, not [B, S]: not concatenated


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return build_fixture(tmp_path_factory.mktemp("split"))


def stream(cfg, steps, dp=1, *, split, state=None, gb=GB, mb=MB):
    return global_stream(cfg, steps, dp, gb=gb, mb=mb, state=state, split=split)


def split_documents(fx, cfg):
    """(tokenizer, held-out count per source, token tuples of held-out docs, of training docs)."""
    sp = load_tokenizer(fx["tokenizer"])
    datasets = [Dataset.load(s.path) for s in cfg.sources]
    held = held_out_documents(cfg, datasets)
    enc = {n: [tuple(t) for t in sp.encode([t for _, t in fx["docs"][n]])] for n in NAMES}
    held_docs = {d for i, n in enumerate(NAMES) for d in enc[n][len(enc[n]) - held[i]:]}
    train_docs = {d for i, n in enumerate(NAMES) for d in enc[n][:len(enc[n]) - held[i]]}
    return sp, held, held_docs, train_docs


def full_documents(batch, eos):
    """Token tuples of the documents that start and end inside the (contiguous) stream."""
    flat = batch["input_ids"].reshape(-1).numpy()
    starts = np.flatnonzero(batch["doc_start"].reshape(-1).numpy())
    docs = []
    for a, b in zip(starts[:-1], starts[1:]):
        assert flat[b - 1] == eos
        docs.append(tuple(flat[a:b - 1].tolist()))
    return docs


def test_default_held_out_counts(fx):
    cfg = fixture_config(fx)
    datasets = [Dataset.load(s.path) for s in cfg.sources]
    held = held_out_documents(cfg, datasets)
    assert held == [auto_valid_documents(ds.index["num_samples"]) for ds in datasets]
    assert all(h >= 1 for h in held)
    assert [auto_valid_documents(n) for n in (1, 2, 20, 21, 1000, 5000, 10**6)] == [0, 1, 1, 2, 50, 200, 200]


@pytest.mark.parametrize("valid_documents", [None, 7])
def test_splits_are_disjoint_and_cover_every_document(fx, valid_documents):
    cfg = fixture_config(fx, valid_documents=valid_documents)
    datasets = [Dataset.load(s.path) for s in cfg.sources]
    held = held_out_documents(cfg, datasets)
    train, valid = planner_for(cfg, "train", datasets=datasets), planner_for(cfg, "valid", datasets=datasets)
    for i, ds in enumerate(datasets):
        n = ds.index["num_samples"]
        # one whole epoch of each split's order for this source
        t_ids = train.orders[i].sample_ids(np.arange(train.orders[i].n))
        v_ids = valid.orders[i].sample_ids(np.arange(valid.orders[i].n))
        assert len(set(t_ids.tolist())) == len(t_ids) == n - held[i]
        assert sorted(v_ids.tolist()) == list(range(n - held[i], n))  # the last `held` samples of the index
        assert not set(t_ids.tolist()) & set(v_ids.tolist()), ds.name
    # and the streams themselves: a long stretch of each covers whole epochs of every source
    for planner, want in ((train, lambda i, n: set(range(n - held[i]))), (valid, lambda i, n: set(range(n - held[i], n)))):
        src, sid = planner.documents(6000)
        for i, ds in enumerate(datasets):
            assert set(sid[src == i].tolist()) == want(i, ds.index["num_samples"]), (planner.split, ds.name)


def test_loader_streams_hold_no_shared_document(fx):
    """Token-level check on what the loaders actually return: every complete document of the valid
    stream is a held-out document; no complete document of the train stream is."""
    cfg = fixture_config(fx)
    sp, held, held_docs, train_docs = split_documents(fx, cfg)
    only_held = held_docs - train_docs  # (identical texts on both sides cannot tell the splits apart)
    assert len(only_held) >= sum(held) - 2

    valid, _ = stream(cfg, 250, split="valid")
    vdocs = full_documents(valid, sp.eos_id())
    assert len(vdocs) > 3 * sum(held)  # cycles through the held-out set several times
    assert set(vdocs) <= held_docs
    assert set(vdocs) >= only_held  # and reaches every held-out document

    train, _ = stream(cfg, 600, split="train")
    tdocs = full_documents(train, sp.eos_id())
    assert len(set(tdocs)) > 300
    assert not set(tdocs) & only_held


@pytest.mark.parametrize("dp,workers", [(2, 0), (4, 0), (2, 1)])
def test_valid_stream_independent_of_dp_size(fx, dp, workers):
    ref, _ = stream(fixture_config(fx), 10, 1, split="valid")
    got, _ = stream(fixture_config(fx, num_workers=workers), 10, dp, split="valid")
    assert_same(ref, got)
    assert ref["doc_start"].any() and (ref["loss_mask"] == 0).any()


def test_valid_split_resumes_exactly(fx):
    cfg = fixture_config(fx)
    ref, _ = stream(cfg, 20, split="valid", gb=16)
    _, loaders = stream(cfg, 7, 2, split="valid", gb=16)
    state = json.loads(json.dumps(loaders[0].state_dict()))
    assert state["split"] == "valid" and list(state["valid_documents"]) == list(NAMES)
    resumed, _ = stream(cfg, 13, 4, split="valid", gb=16, state=state)
    assert_same({k: v[7 * 16:] for k, v in ref.items()}, resumed)


def test_train_split_without_holdout_is_the_unsplit_stream(fx):
    cfg = fixture_config(fx, valid_documents=0)
    datasets = [Dataset.load(s.path) for s in cfg.sources]
    a = Planner(datasets, cfg.weights, cfg.seed, weight_by=cfg.weight_by).documents(5000)
    b = planner_for(cfg, "train", datasets=datasets).documents(5000)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    # with a hold-out and document weights, the train stream only loses documents: the source choice is
    # unchanged (token weights are turned into document shares with each split's own mean length)
    a = Planner(datasets, cfg.weights, cfg.seed, weight_by="documents").documents(5000)
    c = planner_for(fixture_config(fx, weight_by="documents"), "train", datasets=datasets).documents(5000)
    assert np.array_equal(a[0], c[0])


def test_state_from_another_split_setting_is_refused(fx):
    kw = dict(micro_batch_size=MB, global_batch_size=GB, dp_rank=0, dp_size=1)
    cfg = fixture_config(fx)
    st = build_loader(cfg, consumed_sequences=16, **kw).state_dict()
    assert st["split"] == "train"
    with pytest.raises(DataError, match="valid_documents"):
        build_loader(fixture_config(fx, valid_documents=3), state=st, **kw)
    with pytest.raises(DataError, match="valid_documents"):
        build_loader(fixture_config(fx, valid_documents=0), state=st, **kw)
    with pytest.raises(DataError, match="'train' split.*'valid' split"):
        build_loader(cfg, state=st, split="valid", **kw)
    # a state from before the split existed (nothing held out) is refused by a split config ...
    old = {k: v for k, v in st.items() if k not in ("split", "valid_documents")}
    with pytest.raises(DataError, match="valid_documents"):
        build_loader(cfg, state=old, **kw)
    # ... and accepted with valid_documents=0, which is that stream
    st0 = build_loader(fixture_config(fx, valid_documents=0), consumed_sequences=16, **kw).state_dict()
    old0 = {k: v for k, v in st0.items() if k not in ("split", "valid_documents")}
    build_loader(fixture_config(fx, valid_documents=0), state=old0, **kw)
    # the same setting is accepted
    assert build_loader(cfg, state=st, **kw).state_dict() == st


def test_bad_split_settings_name_the_field(fx):
    kw = dict(micro_batch_size=MB, global_batch_size=GB, dp_rank=0, dp_size=1)
    with pytest.raises(ValidationError, match="valid_documents"):
        fixture_config(fx, valid_documents=-1)
    with pytest.raises(DataError, match=r"^valid_documents=60 .*'code'"):  # code has 60 documents
        build_loader(fixture_config(fx, valid_documents=60), **kw)
    with pytest.raises(DataError, match=r"'valid' split is empty: valid_documents=0"):
        build_loader(fixture_config(fx, valid_documents=0), split="valid", **kw)
    with pytest.raises(ValueError, match="split"):
        build_loader(fixture_config(fx), split="test", **kw)


def test_trainer_validation_reads_only_held_out_documents(fx):
    from fbt_megatron.recipe import load_recipe
    from fbt_megatron.data.loaders import build_train_loader, build_valid_batches

    cfg = fixture_config(fx)
    pipeline = cfg.model_dump(exclude={"seq_length"})
    recipe = load_recipe(data={"data": {"source": "pipeline", "seq_length": S, "pipeline": pipeline,
                                        "valid_sequences": 64},
                               "batch": {"micro_batch_size": 2, "global_batch_size": 8}})
    sp, held, held_docs, train_docs = split_documents(fx, cfg)

    batches = build_valid_batches(recipe, 0, 1)
    valid = {k: torch.cat([b[k] for b in batches]) for k in batches[0] if k not in DOCUMENTS}
    assert valid["input_ids"].shape[0] == 64
    vdocs = full_documents(valid, sp.eos_id())
    assert vdocs and set(vdocs) <= held_docs
    # the same set at DP=2 (rank shares concatenated)
    halves = [build_valid_batches(recipe, r, 2) for r in range(2)]
    both = torch.cat([b["input_ids"] for h in halves for b in h])
    assert torch.equal(both, valid["input_ids"])

    train = build_train_loader(recipe, 0, 1, 0)
    tb = [next(train) for _ in range(4 * 20)]
    tdocs = full_documents({k: torch.cat([b[k] for b in tb]) for k in tb[0] if k not in DOCUMENTS}, sp.eos_id())
    assert tdocs and not set(tdocs) & (held_docs - train_docs)


def _recipe(seq_length=S, micro_batch_size=MB, extra=()):
    from fbt_megatron.recipe import load_recipe

    return load_recipe("recipes/tiny.yaml", [f"data.seq_length={seq_length}", f"model.max_sequence_length={seq_length}",
                                             f"batch.micro_batch_size={micro_batch_size}", *extra])


@pytest.mark.parametrize("weight_by", ["tokens", "documents"])
def test_held_out_sets_read_every_held_out_document_once_whatever_the_seed(fx, weight_by):
    """A study's read-out set (``held_out_sets``): per source, the held-out stream of data seed 0 from its
    start, cut into rows (inputs and next-token labels), short of its end by less than a micro-batch and a
    row; the same for every ``data.seed``; each source's share of the mix's tokens (by documents: the weight
    times the training split's mean document length, tokens and EOS)."""
    from fbt_megatron.data.loaders import held_out_sets

    sp, held, _, _ = split_documents(fx, fixture_config(fx, valid_documents=7))
    sets = {seed: held_out_sets(_recipe(), data_config=fixture_config(fx, valid_documents=7, seed=seed,
                                                                      weight_by=weight_by)) for seed in (1, 2)}
    assert [name for name, _, _ in sets[1]] == [name for name, _, _ in sets[2]] == list(NAMES)
    train_lengths = {}
    for i, (name, share, batches) in enumerate(sets[1]):
        assert sets[2][i][1] == share
        for a, b in zip(batches, sets[2][i][2], strict=True):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
        docs = sp.encode([t for _, t in fx["docs"][name]])
        cut = len(docs) - held[i]
        last = docs[cut:]  # the index's last `held` documents
        train_lengths[name] = sum(len(d) + 1 for d in docs[:cut]) / cut
        one = fixture_config(fx, valid_documents=7, seed=0)
        order = planner_for(one.model_copy(update={"sources": [one.sources[i]]}), "valid").orders[0]
        expected = [tok for j in order.sample_ids(np.arange(order.n)) - cut for tok in [*last[j], sp.eos_id()]]
        inputs = torch.cat([b["input_ids"] for b in batches])
        labels = torch.cat([b["labels"] for b in batches])
        for r in range(inputs.shape[0]):
            assert inputs[r].tolist() == expected[r * S:(r + 1) * S], (name, r)
            assert labels[r].tolist() == expected[r * S + 1:(r + 1) * S + 1], (name, r)
        assert len(expected) - 1 - inputs.numel() < S * MB + S, name
    weights = dict(zip(NAMES, (0.5, 0.2, 0.3)))
    if weight_by == "documents":
        weights = {n: w * train_lengths[n] for n, w in weights.items()}
    total = sum(weights.values())
    assert {n: share for n, share, _ in sets[1]} == pytest.approx({n: w / total for n, w in weights.items()})


def test_held_out_sets_cut_each_source_to_max_rows_in_micro_batches_of_at_most_the_recipes(fx):
    """``max_rows`` below the micro-batch: that many rows, in one micro-batch of that size, for every source
    (a smaller micro-batch for one source does not carry over to the next)."""
    from fbt_megatron.data.loaders import held_out_sets

    cfg = fixture_config(fx, valid_documents=7)
    full = held_out_sets(_recipe(micro_batch_size=4), data_config=cfg)
    for max_rows, shape in ((3, [3]), (4, [4]), (9, [4, 4])):
        cut = held_out_sets(_recipe(micro_batch_size=4), data_config=cfg, max_rows=max_rows)
        assert [name for name, _, _ in cut] == list(NAMES)
        for (name, _, batches), (_, _, whole) in zip(cut, full, strict=True):
            assert [b["input_ids"].shape[0] for b in batches] == shape, (name, max_rows)
            rows = torch.cat([b["input_ids"] for b in batches])
            assert torch.equal(rows, torch.cat([b["input_ids"] for b in whole])[:rows.shape[0]])


@pytest.mark.parametrize("valid_documents", [1, 2])
def test_held_out_sets_give_each_source_its_own_micro_batch(fx, valid_documents):
    """Few held-out documents: each source's rows (its held-out tokens and EOS, less one, over S) in micro-
    batches of min(the recipe's, its rows), a smaller one for one source not carried to the next; a source
    without one whole row is left out and the others' shares renormalised."""
    from fbt_megatron.data.loaders import held_out_sets

    sp, held, _, _ = split_documents(fx, fixture_config(fx, valid_documents=valid_documents))
    expected = {}
    for name, h in zip(NAMES, held):
        docs = sp.encode([t for _, t in fx["docs"][name]])
        rows = (sum(len(d) + 1 for d in docs[len(docs) - h:]) - 1) // S
        if rows:
            micro = min(4, rows)
            expected[name] = [micro] * (rows // micro)
    assert len(set(map(len, expected.values()))) > 1 or len(expected) < len(NAMES)  # the case the test is for
    got = held_out_sets(_recipe(micro_batch_size=4), data_config=fixture_config(fx, valid_documents=valid_documents))
    assert {name: [b["input_ids"].shape[0] for b in batches] for name, _, batches in got} == expected
    weights = {n: w for n, w in zip(NAMES, (0.5, 0.2, 0.3)) if n in expected}
    assert {n: share for n, share, _ in got} == pytest.approx({n: w / sum(weights.values()) for n, w in weights.items()})


def test_held_out_sets_skip_a_source_that_holds_nothing_out(fx, tmp_path):
    """A source of one document holds none out: the others are read, their shares renormalised; when no
    source holds one out, one sentence says so."""
    from data_pipeline.config import SourceConfig
    from fbt_megatron.data.loaders import held_out_sets
    from fbt_megatron.recipe import RecipeError

    cfg = fixture_config(fx)
    lone = _one_document_source(fx, tmp_path)
    mixed = cfg.model_copy(update={"sources": [*cfg.sources, SourceConfig(name="lone", path=str(lone), weight=0.5)]})
    got = held_out_sets(_recipe(), data_config=mixed)
    assert [name for name, _, _ in got] == list(NAMES)
    assert {n: share for n, share, _ in got} == pytest.approx({"web": 0.5, "code": 0.2, "math": 0.3})
    alone = cfg.model_copy(update={"sources": [SourceConfig(name="lone", path=str(lone), weight=1.0)]})
    with pytest.raises(RecipeError, match="hold out no row"):
        held_out_sets(_recipe(), data_config=alone)


def _one_document_source(fx, tmp_path):
    """A prepared source of one document (the automatic split holds none of it out)."""
    from data_pipeline.prepare import prepare_dataset

    src = tmp_path / "lone.jsonl"
    src.write_text(json.dumps({"id": "only", "text": fx["docs"]["web"][0][1]}) + "\n")
    out = tmp_path / "lone"
    prepare_dataset([str(src)], out, fx["tokenizer"], name="lone", num_workers=1, progress=False)
    assert auto_valid_documents(Dataset.load(out).index["num_samples"]) == 0
    return out


def test_held_out_sets_of_synthetic_data_are_data_seed_zeros_validation():
    from fbt_megatron.data.loaders import build_valid_batches, held_out_sets

    state = ["data.source=synthetic", "data.synthetic.task=state_tracking", "data.synthetic.vocab_size=6",
             "model.vocab_size=6", "data.valid_sequences=8"]
    got = {seed: held_out_sets(_recipe(32, 4, [*state, f"data.seed={seed}"])) for seed in (1, 2)}
    zero = build_valid_batches(_recipe(32, 4, [*state, "data.seed=0"]), 0, 1)
    one = build_valid_batches(_recipe(32, 4, [*state, "data.seed=1"]), 0, 1)
    for seed in (1, 2):
        (name, share, batches), = got[seed]
        assert (name, share) == ("synthetic", 1.0)
        assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(batches, zero, strict=True))
    assert not all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(zero, one))  # the seed matters there
