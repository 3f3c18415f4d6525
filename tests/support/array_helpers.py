"""Shared by tests/unit/test_data_array.py and tests/integration/test_slurm_prepare.py: a corpus of every input format and
the comparison of a job-array prepare with a one-process prepare."""

import json

import numpy as np

from data_pipeline.shards import Dataset, DatasetReader
from tests.support.data_fixtures import WORDS

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
    differ = {"num_shards", "seconds", "prepare", "settings_hash"}  # shards restart per slice; timings; identity
    assert {k: v for k, v in a.items() if k not in differ} == {k: v for k, v in b.items() if k not in differ}
    for f in ("lengths.npy", "crc32.npy"):
        assert np.array_equal(np.load(out / f), np.load(ref / f)), f
    assert samples(out) == samples(ref)
    from data_pipeline.config import DataConfig, SourceConfig
    from tests.support.data_fixtures import assert_same_batches, global_stream

    def cfg(p):
        return DataConfig(sources=[SourceConfig(name="c", path=str(p), weight=1.0)], tokenizer=str(tok), seq_length=24)

    assert_same_batches(global_stream(cfg(out), 6)[0], global_stream(cfg(ref), 6)[0])
