"""The global token stream: which document comes next, and where every token of it sits.

Everything here is arithmetic on the datasets' indexes (sample lengths); no shard is read. That is
what makes the stream independent of the data-parallel size and of the number of loader workers: every
rank and worker computes the same global stream and reads only the documents its own sequences use.

Definition (seed ``s``, normalised weights ``w``, block size ``B = 1024`` documents):

* **Weights.** With ``weight_by: documents`` the ``w_i`` are document shares. With ``weight_by: tokens``
  (the default of a recipe's ``data:`` section) they are shares of stream tokens; they are turned into
  document shares ``w_i / m_i`` (normalised), ``m_i`` = the mean positions per document (tokens + EOS)
  of source ``i``'s split, read from the index in O(shards). Over whole epochs of a source the token
  share is then exact; per block, the document counts are exact as below.
* **Source choice.** Documents of the stream are grouped in blocks of ``B``. Block ``b`` holds exactly
  ``floor(w_i * B)`` documents of source ``i`` plus the remaining ``B - sum floor(.)`` documents given
  by systematic sampling on the fractional parts (so every source's expected count is exactly
  ``w_i * B``), shuffled with ``numpy.random.default_rng([s, 0x5EED, b])``. The mix over any block is
  exact to one document per source.
* **Order within a source (document shuffling).** The ``k``-th document taken from a source is
  ``perm_e(k mod N)`` of epoch ``e = k // N`` (``N`` = the documents of the source's split), where
  ``perm_e`` is a Feistel permutation of ``[0, N)`` keyed by ``(s, crc32(name), e)``
  (:class:`FeistelPermutation`): every epoch visits every document once, in a fresh whole-source
  order, and any ``k`` maps to its document in O(1) time and memory.
* **Packing.** Documents are concatenated, each followed by EOS. Document ``d`` occupies
  ``len(d) + 1`` positions of the token stream. Global sequence ``j`` covers stream positions
  ``[P0 + (j - c0) * S, P0 + (j - c0) * S + S + 1)`` (``S + 1`` tokens: inputs and next-token labels,
  consecutive sequences overlap by one token, as in Megatron's GPT dataset); ``P0 = c0 * S`` for a
  fresh stream.
* **Splits.** Each source holds out its last ``h`` sample ids (by position in its ``index.json``;
  ``h`` from ``valid_documents``, see :func:`auto_valid_documents`). The ``train`` split of a
  source is sample ids ``[0, N - h)``, the ``valid`` split ``[N - h, N)``; the valid split's source choice
  runs over the sources that hold out at least one document (weights renormalised). Everything else is
  the same definition; with ``h = 0`` the train split is exactly the unsplit stream.
* **Bad shards** (only with ``allow_skip_corrupt``) do not change the stream: their documents keep
  their positions and are replaced by loss-masked spans (see ``loader.py``).
* **Cursor.** A position ``P`` of the stream is the document ``doc_index`` holding it, the offset in
  that document, and per source the number of documents taken before ``doc_index``. That triple plus
  the seed is the loader state; resuming needs no replay.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from .errors import DataError
from .shards import Dataset

BLOCK = 1024
SPLITS = ("train", "valid")
WEIGHT_BY = ("tokens", "documents")
VALID_CAP = 200  # automatic held-out documents per source: min(VALID_CAP, ceil(n / VALID_DIVISOR))
VALID_DIVISOR = 20  # (5%)


def auto_valid_documents(num_samples: int) -> int:
    """Default held-out documents of a source with ``num_samples`` documents (its index's count)."""
    n = int(num_samples)
    return 0 if n < 2 else min(VALID_CAP, -(-n // VALID_DIVISOR))


def split_layout(ds: Dataset, held_out: int, split: str) -> tuple[int, int]:
    """(first sample id, number of samples) of ``split`` in a source: ``train`` is sample ids
    ``[0, N - held_out)``, ``valid`` is ``[N - held_out, N)`` (``N``: the index's ``num_samples``)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    cut = ds.num_samples - int(held_out)
    return (0, cut) if split == "train" else (cut, int(held_out))


_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a cheap, well-mixed 64-bit hash (uint64 arithmetic wraps)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


class FeistelPermutation:
    """A seeded bijection of ``[0, n)`` with O(1) memory and random access (a Feistel network).

    A value of ``bits = bit_length(n - 1)`` bits is split into a high part ``L`` and a low part ``R``;
    rounds alternately XOR one part with a keyed splitmix64 hash of the other (each such step is its own
    inverse, so the whole is a bijection of ``[0, 2^bits)``, also when the parts differ in width).
    Values ``>= n`` are cycle-walked (mapped again until they fall in range; ``2^bits < 2n``, so fewer
    than 2 walks are expected)."""

    ROUNDS = 8

    def __init__(self, n: int, key: list[int]):
        self.n = int(n)
        bits = max(1, (self.n - 1).bit_length())
        low = (bits + 1) // 2
        self.low = np.uint64(low)
        self.low_mask = np.uint64((1 << low) - 1)
        self.high_mask = np.uint64((1 << (bits - low)) - 1)
        self.keys = np.random.default_rng(key).integers(0, 2**63, size=self.ROUNDS, dtype=np.uint64)

    def _rounds(self, x: np.ndarray) -> np.ndarray:
        high, low = x >> self.low, x & self.low_mask
        for r, k in enumerate(self.keys):
            if r % 2 == 0:
                high = high ^ (_mix64(low ^ k) & self.high_mask)
            else:
                low = low ^ (_mix64(high ^ k) & self.low_mask)
        return (high << self.low) | low

    def __call__(self, pos: np.ndarray) -> np.ndarray:
        y = self._rounds(np.asarray(pos, np.uint64))
        out = y >= self.n
        while out.any():
            y[out] = self._rounds(y[out])
            out = y >= self.n
        return y.astype(np.int64)


class SourceOrder:
    """k-th document taken from a source -> sample id in its dataset.

    Epoch ``e = k // n`` visits the split's ``n`` documents in the order of a Feistel permutation keyed
    by ``(seed, crc32(name), e)``: a whole-source shuffle that is a pure function of ``k``."""

    def __init__(self, ds: Dataset, seed: int, layout=None):
        self.ds = ds
        self.seed = seed
        self.lo, self.n = split_layout(ds, 0, "train") if layout is None else layout
        self.name_key = zlib.crc32(ds.name.encode())
        self._perms: dict[int, FeistelPermutation] = {}

    def permutation(self, e: int) -> FeistelPermutation:
        perm = self._perms.get(e)
        if perm is None:
            if len(self._perms) > 8:
                self._perms.clear()
            perm = self._perms[e] = FeistelPermutation(self.n, [self.seed, self.name_key, e])
        return perm

    def sample_ids(self, ks: np.ndarray) -> np.ndarray:
        ks = np.asarray(ks, np.int64)
        out = np.empty_like(ks)
        epochs = ks // self.n
        pos = ks - epochs * self.n
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self.lo + self.permutation(int(e))(pos[sel])
        return out

    def mean_length(self) -> float:
        """Mean stream positions per document of this split (tokens + its EOS)."""
        return self.ds.tokens_between(self.lo, self.lo + self.n) / self.n + 1.0


def block_sources(seed: int, weights: np.ndarray, b: int, block: int = BLOCK) -> np.ndarray:
    """Source index of each document of block ``b`` (length ``block``)."""
    rng = np.random.default_rng([seed, 0x5EED, b])
    quota = np.asarray(weights, np.float64) * block
    base = np.floor(quota).astype(np.int64)
    r = block - int(base.sum())
    counts = base
    if r > 0:
        cum = np.cumsum(quota - base)
        cum[-1] = r
        prev = np.concatenate([[0.0], cum[:-1]])
        u = rng.random()
        counts = base + (np.ceil(cum - u) - np.ceil(prev - u)).astype(np.int64)
    labels = np.repeat(np.arange(len(weights)), counts)
    rng.shuffle(labels)
    return labels


@dataclass
class Block:
    b: int
    src: np.ndarray  # (B,) source index
    k: np.ndarray  # (B,) k-th document of that source
    sid: np.ndarray  # (B,) sample id in the source's dataset
    length: np.ndarray  # (B,) tokens incl. EOS
    start: np.ndarray  # (B,) absolute stream position of the first token
    base_k: np.ndarray  # (n_src,) documents taken per source before this block
    end_k: np.ndarray  # (n_src,) after this block

    @property
    def end(self) -> int:
        return int(self.start[-1] + self.length[-1])


class Planner:
    """Walks the global stream forward and answers "which documents cover positions [a, b)"."""

    def __init__(self, datasets: list[Dataset], weights, seed: int, *, held_out=None, split: str = "train",
                 weight_by: str = "documents"):
        """``held_out``: per source, the number of held-out documents (default none); ``split``: which
        side of the split the stream reads; ``weight_by``: whether ``weights`` are shares of documents or
        of tokens (see the module docstring)."""
        if weight_by not in WEIGHT_BY:
            raise ValueError(f"weight_by must be one of {WEIGHT_BY}, got {weight_by!r}")
        self.datasets = datasets
        self.weights = np.asarray(weights, np.float64) / float(np.sum(weights))
        self.seed = seed
        self.split = split
        self.weight_by = weight_by
        self.held_out = [0] * len(datasets) if held_out is None else [int(h) for h in held_out]
        self.orders = [SourceOrder(ds, seed, split_layout(ds, h, split)) for ds, h in zip(datasets, self.held_out)]
        active = [i for i, o in enumerate(self.orders) if o.n > 0]
        empty = [ds.name for i, ds in enumerate(datasets) if i not in active]
        if split == "train" and empty:
            raise DataError(f"sources {empty} have no training document left (held out: "
                            f"{dict((ds.name, h) for ds, h in zip(datasets, self.held_out))}; valid_documents)")
        if not active:
            raise DataError(f"the {split!r} split holds no usable document in any source (held out per source: "
                            f"{dict((ds.name, h) for ds, h in zip(datasets, self.held_out))}; valid_documents)")
        self._active = np.asarray(active, np.int64)
        w = self.weights[self._active]
        if weight_by == "tokens":  # a token share over the mean document length is a document share
            w = w / np.array([self.orders[i].mean_length() for i in active])
        self._active_weights = w / float(w.sum())
        self._blocks: list[Block] = []

    def block_sources(self, b: int) -> np.ndarray:
        """Source index of each document of block ``b`` (sources without a document are never drawn)."""
        return self._active[block_sources(self.seed, self._active_weights, b)]

    # -- block generation
    def _make_block(self, b: int, base_k: np.ndarray, start_pos: int | None, *, anchor=None) -> Block:
        src = self.block_sources(b)
        k = np.empty(len(src), np.int64)
        sid = np.empty(len(src), np.int64)
        length = np.empty(len(src), np.int64)
        counts = np.zeros(len(self.datasets), np.int64)
        for i, order in enumerate(self.orders):
            sel = src == i
            n = int(sel.sum())
            k[sel] = base_k[i] + np.arange(n)
            sid[sel] = order.sample_ids(k[sel])
            length[sel] = self.datasets[i].lengths[sid[sel]].astype(np.int64) + 1
            counts[i] = n
        if start_pos is None:  # anchored: (local doc j, its absolute start)
            j, pos_j = anchor
            start_pos = pos_j - int(length[:j].sum())
        start = start_pos + np.concatenate([[0], np.cumsum(length)[:-1]])
        return Block(b, src, k, sid, length, start, base_k.copy(), base_k + counts)

    def reset(self) -> None:
        zero = np.zeros(len(self.datasets), np.int64)
        self._blocks = [self._make_block(0, zero, 0)]

    def reset_to(self, doc_index: int, per_source: np.ndarray, doc_offset: int, position: int) -> None:
        """Position the walker at a cursor (see module docstring)."""
        b, j = divmod(int(doc_index), BLOCK)
        src = self.block_sources(b)
        before = np.bincount(src[:j], minlength=len(self.datasets)).astype(np.int64)
        base_k = np.asarray(per_source, np.int64) - before
        if (base_k < 0).any():
            raise ValueError("loader state is inconsistent: per-source counts below the block's own count")
        self._blocks = [self._make_block(b, base_k, None, anchor=(j, int(position) - int(doc_offset)))]

    def _next_block(self) -> Block:
        last = self._blocks[-1]
        blk = self._make_block(last.b + 1, last.end_k, last.end)
        self._blocks.append(blk)
        return blk

    def _blocks_covering(self, a: int, b: int):
        if not self._blocks:
            self.reset()
        if a < self._blocks[0].start[0]:
            raise ValueError(f"position {a} is behind the walker (at {int(self._blocks[0].start[0])})")
        while self._blocks[-1].end <= a:
            self._next_block()
        # drop blocks entirely before a
        while len(self._blocks) > 1 and self._blocks[0].end <= a:
            self._blocks.pop(0)
        out = []
        i = 0
        while True:
            if i == len(self._blocks):
                self._next_block()
            blk = self._blocks[i]
            out.append(blk)
            if blk.end >= b:
                return out
            i += 1

    # -- queries
    def pieces(self, a: int, b: int):
        """Documents overlapping stream positions [a, b): list of
        (src, sid, doc_len_incl_eos, lo, hi, out_pos) with [lo, hi) the slice of the document (with EOS)
        landing at out_pos..out_pos+hi-lo of the output."""
        out = []
        for blk in self._blocks_covering(a, b):
            ends = blk.start + blk.length
            j0 = int(np.searchsorted(ends, a, side="right"))
            j1 = int(np.searchsorted(blk.start, b, side="left"))
            for j in range(j0, j1):
                s = int(blk.start[j])
                lo = max(a, s) - s
                hi = min(b, s + int(blk.length[j])) - s
                out.append((int(blk.src[j]), int(blk.sid[j]), int(blk.length[j]), lo, hi, s + lo - a))
        return out

    def locate(self, position: int) -> dict:
        """Cursor at a stream position: doc_index, doc_offset, per-source documents taken before it."""
        blk = self._blocks_covering(position, position + 1)[0]
        ends = blk.start + blk.length
        j = int(np.searchsorted(ends, position, side="right"))
        before = np.bincount(blk.src[:j], minlength=len(self.datasets))
        return {
            "doc_index": blk.b * BLOCK + j,
            "doc_offset": int(position - blk.start[j]),
            "per_source": (blk.base_k + before).astype(np.int64),
        }

    def documents(self, n: int):
        """First ``n`` documents of the stream from position 0: (src, sid) arrays (tests, inspection)."""
        self.reset()
        srcs, sids = [], []
        while sum(len(x) for x in srcs) < n:
            blk = self._blocks[-1]
            srcs.append(blk.src)
            sids.append(blk.sid)
            self._next_block()
        return np.concatenate(srcs)[:n], np.concatenate(sids)[:n]
