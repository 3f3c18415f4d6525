"""A prepared dataset's fingerprint: what a run records to notice that its data changed under it.

``{"tokenizer_hash", "documents", "content"}``: the tokenizer the index was built with, the document
count, and a hash of each document's token count and token CRC-32 in index order (``lengths`` and
``crc32``: 8 bytes a document, so cheap; the shards themselves are not read). Re-preparing the same
documents with the same tokenizer gives the same fingerprint; other documents, another order or another
tokenizer give another.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from .shards import Dataset


CHUNK = 1 << 22  # documents hashed at a time: the index arrays are memory-mapped, a copy stays this small


def dataset_fingerprint(path: str | Path) -> dict:
    ds = Dataset.load(path)
    h = hashlib.blake2b(digest_size=16)
    for arr, dtype in ((ds.lengths, "<i8"), (ds.crc32, "<u8")):
        for start in range(0, len(arr), CHUNK):
            h.update(np.ascontiguousarray(arr[start:start + CHUNK], dtype=dtype).tobytes())
    return {"tokenizer_hash": ds.index["tokenizer_hash"], "documents": ds.num_samples, "content": h.hexdigest()}
