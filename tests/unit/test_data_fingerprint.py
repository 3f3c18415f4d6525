"""A dataset's fingerprint (data_pipeline/fingerprint.py): the hash of every document's token count and CRC-32,
taken in bounded chunks so a 10^8-document index is never copied whole."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from tests.support.data_fixtures import build_fixture


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return build_fixture(tmp_path_factory.mktemp("fingerprint"))


def _reference(path) -> dict:
    """The fingerprint from its definition: blake2b-128 over the lengths as little-endian int64, then the
    CRC-32s as little-endian uint64, in index order."""
    lengths = np.load(path / "lengths.npy").astype("<i8")
    crcs = np.load(path / "crc32.npy").astype("<u8")
    index = json.loads((path / "index.json").read_text())
    digest = hashlib.blake2b(lengths.tobytes() + crcs.tobytes(), digest_size=16).hexdigest()
    return {"tokenizer_hash": index["tokenizer_hash"], "documents": len(lengths), "content": digest}


@pytest.mark.parametrize("chunk", [1, 7, 1 << 22])
def test_the_fingerprint_is_the_formula_whatever_the_chunk(fx, monkeypatch, chunk):
    from data_pipeline import fingerprint

    monkeypatch.setattr(fingerprint, "CHUNK", chunk)
    for name in ("web", "code", "math"):
        assert fingerprint.dataset_fingerprint(fx["root"] / name) == _reference(fx["root"] / name), name


def test_another_dataset_has_another_fingerprint(fx):
    from data_pipeline.fingerprint import dataset_fingerprint

    assert dataset_fingerprint(fx["root"] / "web")["content"] != dataset_fingerprint(fx["root"] / "math")["content"]
