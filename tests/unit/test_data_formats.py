"""`fbt data prepare` inputs beside JSONL and text: `.jsonl.zst`, Parquet (streamed by row group) and a
`datasets` save directory (Arrow). Each file is written by its own library (zstandard, pyarrow,
datasets) from the same documents; every format yields those documents in order and the same token
stream. A missing column, a corrupt file or a bad row is an error naming the file and the row (or a
counted skip under skip_bad_rows), and no dataset directory is written."""

import json

import pytest

from data_pipeline.errors import SourceError
from data_pipeline.sources import iter_documents

TEXTS = [f"document {i}: " + " ".join(["river", "stone", "light", "seven"][(i + j) % 4] for j in range(i % 9 + 1))
         for i in range(40)]
IDS = [f"doc-{i}" for i in range(40)]


def _jsonl_bytes(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _zst(path, data: bytes):
    import zstandard

    path.write_bytes(zstandard.ZstdCompressor().compress(data))
    return path


def _parquet(path, texts=TEXTS, ids=IDS, column="text"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: texts, "id": ids}), path, row_group_size=7)  # 6 row groups
    return path


def _datasets_save(path):
    import datasets

    datasets.Dataset.from_dict({"text": TEXTS, "id": IDS}).save_to_disk(str(path), num_shards=3)
    return path


@pytest.fixture()
def inputs(tmp_path):
    rows = [{"text": t, "id": i} for t, i in zip(TEXTS, IDS)]
    return {"jsonl": _zst(tmp_path / "docs.jsonl.zst", _jsonl_bytes(rows)),
            "parquet": _parquet(tmp_path / "docs.parquet"),
            "arrow": _datasets_save(tmp_path / "saved")}


def test_every_format_yields_the_documents(inputs):
    import pyarrow.parquet as pq

    assert pq.ParquetFile(inputs["parquet"]).num_row_groups == 6
    assert len(list(inputs["arrow"].glob("*.arrow"))) == 3
    for kind, path in inputs.items():
        assert list(iter_documents([str(path)])) == list(zip(IDS, TEXTS)), kind
    # several zstd frames one after the other (as `cat a.zst b.zst` or a streaming writer leaves them)
    import zstandard

    rows = [{"text": t, "id": i} for t, i in zip(TEXTS, IDS)]
    frames = inputs["jsonl"].with_name("frames.jsonl.zst")
    frames.write_bytes(b"".join(zstandard.ZstdCompressor().compress(_jsonl_bytes(rows[a:a + 15])) for a in (0, 15, 30)))
    assert list(iter_documents([str(frames)])) == list(zip(IDS, TEXTS))


def test_formats_prepare_the_same_tokens(inputs, tmp_path):
    from data_pipeline.prepare import prepare_dataset
    from tests.support.data_fixtures import train_hf_bpe

    tok = train_hf_bpe(TEXTS, tmp_path / "tok", vocab_size=120)
    out = {k: prepare_dataset([str(p)], tmp_path / k, tok, name="corpus", shard_bytes=300, progress=False)
           for k, p in inputs.items()}
    assert {v["num_tokens"] for v in out.values()} == {out["jsonl"]["num_tokens"]}
    for k in out:  # the shards themselves, byte for byte
        shards = sorted((tmp_path / k).glob("shard-*.tar"))
        assert [s.read_bytes() for s in shards] == [s.read_bytes() for s in sorted((tmp_path / "jsonl").glob("shard-*.tar"))], k


def test_bad_inputs_name_file_and_row(tmp_path):
    from data_pipeline.prepare import prepare_dataset
    from tests.support.data_fixtures import train_hf_bpe

    tok = train_hf_bpe(TEXTS, tmp_path / "tok", vocab_size=120)
    nulls = _parquet(tmp_path / "nulls.parquet", texts=TEXTS[:12] + [None] + TEXTS[13:])
    with pytest.raises(SourceError, match=r"nulls.parquet row 12: field 'text' is null"):
        prepare_dataset([str(nulls)], tmp_path / "out", tok, progress=False)
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "out.tmp").exists()  # no shard was done: nothing to resume is left behind
    index = prepare_dataset([str(nulls)], tmp_path / "out", tok, progress=False, skip_bad_rows=True)
    assert index["num_samples"] == 39 and index["skipped_bad_rows"] == 1 and "row 12" in index["first_bad_row"]

    with pytest.raises(SourceError, match=r"wrong.parquet: no column 'text' \(columns: \['body', 'id'\]\)"):
        list(iter_documents([str(_parquet(tmp_path / "wrong.parquet", column="body"))]))
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(nulls.read_bytes()[:-100])
    with pytest.raises(SourceError, match=r"cannot read Parquet file .*corrupt.parquet"):
        list(iter_documents([str(corrupt)]))

    lines = _jsonl_bytes([{"text": t} for t in TEXTS[:5]]).split(b"\n")
    lines[2] = b'{"text": "caf\xe9"}'  # latin-1, not UTF-8
    bad = _zst(tmp_path / "bad.jsonl.zst", b"\n".join(lines))
    with pytest.raises(SourceError, match=r"bad.jsonl.zst:3: not UTF-8"):
        list(iter_documents([str(bad)]))
    counts: dict = {}
    assert len(list(iter_documents([str(bad)], skip_bad_rows=True, counts=counts))) == 4 and counts["bad_rows"] == 1
    truncated = tmp_path / "truncated.jsonl.zst"
    truncated.write_bytes(_zst(tmp_path / "whole.jsonl.zst", _jsonl_bytes([{"text": t} for t in TEXTS])).read_bytes()[:-20])
    with pytest.raises(SourceError, match=r"cannot read source file .*truncated.jsonl.zst \(after line \d+\)"):
        list(iter_documents([str(truncated)]))

    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(SourceError, match=r"dd is a datasets DatasetDict: give one split's directory \(\['train'\]\)"):
        list(iter_documents([str(tmp_path / "dd")]))
