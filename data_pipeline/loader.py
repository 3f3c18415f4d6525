"""Streaming loader: packed fixed-length sequences of the token mix, sharded over data-parallel ranks
and DataLoader workers, with an exact, DP-independent resume cursor.

Usage (trainer side)::

    loader = build_loader(cfg.data, micro_batch_size=8, global_batch_size=64, dp_rank=r, dp_size=d)
    for step in range(steps):
        for _ in range(loader.micro_batches_per_step):
            batch = next(loader)            # or: for batch in loader
            ...
        ckpt["data"] = loader.state_dict()  # after the step
    # resume, with any dp_size / num_workers:
    loader = build_loader(cfg.data, ..., dp_rank=r, dp_size=d2, state=ckpt["data"])

The global stream of sequences is defined in :mod:`data_pipeline.stream`. For global step ``t`` (counted
from the cursor) the global batch is sequences ``c0 + t*G .. c0 + (t+1)*G - 1``; rank ``r`` gets the
contiguous block ``[r*G/D, (r+1)*G/D)`` of it, split into micro-batches of ``micro_batch_size`` in
order. With ``W`` DataLoader workers, worker ``w`` builds the rank's micro-batches ``w, w+W, ...`` and
PyTorch's DataLoader returns them round-robin, i.e. in order.

Each micro-batch is a dict of tensors, all ``[B, S]``:
``input_ids`` int64, ``labels`` int64 (next token: sequence ``j`` is cut from ``S + 1`` stream tokens),
``loss_mask`` float32 (0 where the input token is EOS, i.e. the label is the next document's first
token, on spans replaced after a corrupt sample, and, in a conversation of a chat dataset, wherever the
label is not one of its assistant tokens: the mask travels with the batch through every layout), ``position_ids`` int64 (``0..S-1``),
``doc_start`` bool (True where a document's first token sits); and, made here once on the host, the
rows' documents laid end to end for packed attention: ``cu_seqlens`` int32 and ``max_seqlen`` an int
(``documents.packed_documents``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .config import DataConfig
from .documents import with_packed_documents
from .errors import DataError, TokenizerMismatchError
from .shards import Dataset, DatasetReader
from .stream import SPLITS, Planner, auto_valid_documents
from .tokenizer import load_tokenizer, tokenizer_hash

log = logging.getLogger(__name__)

STATE_VERSION = 2  # 2: documents shuffled within each epoch, weight_by (version 1 streams differ)


class _Spec:
    """Everything a worker needs to rebuild the stream (picklable)."""

    def __init__(self, datasets, weights, seed, seq_length, eos_id, allow_skip,
                 micro_batch_size, global_batch_size, dp_rank, dp_size, cursor, held_out=None, split="train",
                 weight_by="documents"):
        self.datasets = datasets
        self.weight_by = weight_by
        self.held_out = held_out
        self.split = split
        self.weights = weights
        self.seed = seed
        self.S = seq_length
        self.eos = eos_id
        self.allow_skip = allow_skip
        self.m = micro_batch_size
        self.G = global_batch_size
        self.r = dp_rank
        self.D = dp_size
        self.cursor = cursor  # dict: consumed_sequences, token_position, doc_index, doc_offset, per_source

    @property
    def mb_per_step(self) -> int:
        return self.G // self.D // self.m

    def new_planner(self) -> Planner:
        p = Planner(self.datasets, self.weights, self.seed, held_out=self.held_out, split=self.split,
                    weight_by=self.weight_by)
        c = self.cursor
        p.reset_to(c["doc_index"], np.asarray(c["per_source"], np.int64), c["doc_offset"], c["token_position"])
        return p

    def first_sequence(self, u: int) -> int:
        """Global sequence index of the first sequence of this rank's micro-batch ``u``."""
        step, q = divmod(u, self.mb_per_step)
        return self.cursor["consumed_sequences"] + step * self.G + self.r * (self.G // self.D) + q * self.m

    def position(self, j: int) -> int:
        return self.cursor["token_position"] + (j - self.cursor["consumed_sequences"]) * self.S


class _Packer:
    """Builds micro-batches from the planner and shard readers (one per process)."""

    def __init__(self, spec: _Spec):
        self.spec = spec
        self.planner = spec.new_planner()
        self.stats: dict = {}
        self.readers = [DatasetReader(ds, allow_skip_corrupt=spec.allow_skip, stats=self.stats)
                        for ds in spec.datasets]
        self._cache: OrderedDict = OrderedDict()
        self._bad_samples: set = set()

    def _doc(self, src: int, sid: int):
        key = (src, sid)
        if key in self._cache:
            return self._cache[key]
        reader = self.readers[src]
        got = reader.get(sid)  # None: corrupt, skipping allowed (logged by the reader)
        if got is None and reader.last_skip == "sample":
            self._bad_samples.add(key)
        got = (got, reader.last_mask) if got is not None else None
        self._cache[key] = got
        if len(self._cache) > 64:
            self._cache.popitem(last=False)
        return got

    def micro_batch(self, u: int) -> dict:
        sp = self.spec
        S, m = sp.S, sp.m
        a = sp.position(sp.first_sequence(u))
        n = m * S + 1
        toks = np.full(n, sp.eos, np.int64)
        start = np.zeros(n, bool)
        bad = np.zeros(n, bool)
        target = None  # per stream position: does the token there carry loss as a label (chat masks)
        skipped = 0
        for src, sid, length, lo, hi, out in self.planner.pieces(a, a + n):
            if lo == 0:
                start[out] = True
            doc = self._doc(src, sid)
            if doc is None:  # corrupt and skipping allowed: EOS filler, loss-masked
                bad[out:out + hi - lo] = True
                # a corrupt document is counted once in the whole global stream: where it starts
                skipped += lo == 0 and (src, sid) in self._bad_samples
                continue
            doc, dmask = doc
            if hi == length:  # slice includes the EOS (already in toks)
                toks[out:out + hi - lo - 1] = doc[lo:]
            else:
                toks[out:out + hi - lo] = doc[lo:hi]
            if dmask is not None:  # a conversation: only its assistant tokens are targets (not the EOS after it)
                if target is None:
                    target = np.ones(n, bool)
                target[out:out + hi - lo] = False
                k = min(hi, length - 1) - lo
                target[out:out + k] = dmask[lo:lo + k].astype(bool)
        # compact form crosses the worker -> main process queue (plain pickled arrays, no shared-memory
        # tensors); ``expand`` builds the [B, S] tensors in the consuming process.
        bad_shards = []  # shards this process found bad since the last micro-batch (the main process counts)
        for src, reader in enumerate(self.readers):
            bad_shards += [(src, sh, int(reader.ds.shard_table[sh, 1])) for sh in reader.new_bad_shards]
            reader.new_bad_shards.clear()
        return {"tokens": toks, "start": start, "bad": bad if bad.any() else None, "target": target, "skipped": skipped,
                "bad_shards": bad_shards, "m": m, "S": S, "eos": sp.eos}


def _identity(x):
    return x


def expand(c: dict) -> dict:
    """Compact micro-batch (``m * S + 1`` stream tokens) -> the trainer's dict of [B, S] tensors."""
    m, S, toks = c["m"], c["S"], c["tokens"]
    inp = toks[: m * S].reshape(m, S)
    lab = toks[1:].reshape(m * S)  # toks[1 : m*S+1]
    lab = lab.reshape(m, S)
    mask = inp != c["eos"]
    if c["bad"] is not None:
        bad = c["bad"]
        mask &= ~bad[: m * S].reshape(m, S) & ~bad[1:].reshape(m, S)
    if c.get("target") is not None:  # chat data: loss only where the label is an assistant token
        mask &= c["target"][1:].reshape(m, S)
    return with_packed_documents({
        "input_ids": torch.from_numpy(np.ascontiguousarray(inp)),
        "labels": torch.from_numpy(np.ascontiguousarray(lab)),
        "loss_mask": torch.from_numpy(mask.astype(np.float32)),
        "position_ids": torch.arange(S, dtype=torch.int64).expand(m, S).contiguous(),
        "doc_start": torch.from_numpy(np.ascontiguousarray(c["start"][: m * S].reshape(m, S))),
    })


class _RankStream(IterableDataset):
    def __init__(self, spec: _Spec, first_micro_batch: int):
        super().__init__()
        self.spec = spec
        self.u0 = first_micro_batch

    def __iter__(self):
        info = get_worker_info()
        w, W = (info.id, info.num_workers) if info is not None else (0, 1)
        packer = _Packer(self.spec)
        u = self.u0 + w
        while True:
            yield packer.micro_batch(u)
            u += W


class TokenLoader:
    """Iterable (and iterator) over this rank's micro-batches; see the module docstring.

    ``state_dict()`` returns the global cursor at the last completed global step (micro-batches of a
    step partly consumed are not counted: a resume replays that step from its start).
    """

    def __init__(self, spec: _Spec, num_workers: int, tokenizer_hash: str, source_names: list[str],
                 stats: dict):
        self._spec = spec
        self.num_workers = num_workers
        self.tokenizer_hash = tokenizer_hash
        self.source_names = source_names
        self.stats = stats  # skipped_shards, skipped_shard_samples, skipped_corrupt_samples
        self.stats.setdefault("skipped_corrupt_samples", 0)
        # bad shards: found missing at build, or truncated/unreadable when a reader first opened them
        self._bad_shards = {(i, sh): int(ds.shard_table[sh, 1]) for i, ds in enumerate(spec.datasets)
                            for sh in ds.bad_shards}
        self._yielded = 0
        self._it = None
        self._locator = spec.new_planner()

    @property
    def micro_batches_per_step(self) -> int:
        return self._spec.mb_per_step

    @property
    def consumed_sequences(self) -> int:
        return self._spec.cursor["consumed_sequences"] + (self._yielded // self._spec.mb_per_step) * self._spec.G

    def _batches(self):
        ds = _RankStream(self._spec, self._yielded)
        if self.num_workers == 0:
            source = iter(ds)
        else:
            source = iter(DataLoader(ds, batch_size=None, num_workers=self.num_workers, collate_fn=_identity,
                                     prefetch_factor=8, persistent_workers=False))
        for compact in source:
            if compact["skipped"]:
                self.stats["skipped_corrupt_samples"] += int(compact["skipped"])
            if compact["bad_shards"]:
                for src, sh, n in compact["bad_shards"]:
                    self._bad_shards[(src, sh)] = n
                self.stats["skipped_shards"] = len(self._bad_shards)
                self.stats["skipped_shard_samples"] = sum(self._bad_shards.values())
            self._yielded += 1
            yield expand(compact)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._it is None:
            self._it = self._batches()
        return next(self._it)

    def close(self) -> None:
        """Stop worker processes (a later ``next`` restarts them at the current position)."""
        self._it = None

    def state_dict(self) -> dict:
        spec = self._spec
        c = self.consumed_sequences
        pos = spec.position(c)
        loc = self._locator.locate(pos)
        return {
            "version": STATE_VERSION,
            "seed": spec.seed,
            "seq_length": spec.S,
            "consumed_sequences": int(c),
            "token_position": int(pos),
            "doc_index": int(loc["doc_index"]),
            "doc_offset": int(loc["doc_offset"]),
            "sources": list(self.source_names),
            "per_source_consumed": {n: int(k) for n, k in zip(self.source_names, loc["per_source"])},
            "weights": {n: float(w) for n, w in zip(self.source_names, spec.weights)},
            "weight_by": spec.weight_by,
            "split": spec.split,
            "valid_documents": {n: int(h) for n, h in zip(self.source_names, spec.held_out)},
            "tokenizer_hash": self.tokenizer_hash,
        }


def build_loader(
    cfg: DataConfig,
    *,
    micro_batch_size: int,
    global_batch_size: int,
    dp_rank: int,
    dp_size: int,
    consumed_sequences: int = 0,
    state: dict | None = None,
    split: str = "train",
) -> TokenLoader:
    """Build this rank's loader.

    Resume either with ``state`` (a dict from ``TokenLoader.state_dict()``; O(1), no replay) or with
    ``consumed_sequences`` alone (the cursor is recomputed from the indexes' sample lengths, no shard
    read). Both give the same stream. The state must come from the same seed, sources, weights and
    tokenizer; ``dp_size``, ``num_workers`` and the batch sizes may differ. If ``seq_length`` differs,
    the stream continues at the state's token position with the new length.

    ``split``: ``"train"`` (every document except the held-out ones) or ``"valid"`` (only the held-out
    documents: the last ``valid_documents`` samples of each source, see
    :func:`held_out_documents`). A state is only accepted by the same split with the same held-out
    counts.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
    if micro_batch_size < 1 or global_batch_size < 1:
        raise ValueError("micro_batch_size and global_batch_size must be >= 1")
    if global_batch_size % dp_size:
        raise ValueError(f"global_batch_size={global_batch_size} is not divisible by dp_size={dp_size}")
    if (global_batch_size // dp_size) % micro_batch_size:
        raise ValueError(f"global_batch_size // dp_size = {global_batch_size // dp_size} is not divisible "
                         f"by micro_batch_size={micro_batch_size}")
    sp = load_tokenizer(cfg.tokenizer)
    thash = tokenizer_hash(cfg.tokenizer)
    stats: dict = {}
    datasets = [Dataset.load(s.path, tokenizer_hash=thash, allow_skip_corrupt=cfg.allow_skip_corrupt, stats=stats)
                for s in cfg.sources]
    for s, ds in zip(cfg.sources, datasets):
        if ds.index["eos_id"] != sp.eos_id():  # pragma: no cover - implied by the hash check
            raise TokenizerMismatchError(f"{ds.path}: eos id {ds.index['eos_id']} != tokenizer's {sp.eos_id()}")
    names = [s.name for s in cfg.sources]
    weights = cfg.weights
    seed, S = cfg.seed, cfg.seq_length
    held_out = held_out_documents(cfg, datasets)
    if split == "valid" and not any(held_out):
        raise DataError(f"the 'valid' split is empty: valid_documents={cfg.valid_documents!r} holds out no "
                        f"document of any source ({dict(zip(names, held_out))})")

    if state is not None:
        if state.get("version") != STATE_VERSION:
            why = (" (version 1 streams documents unshuffled, by document weights: it names positions in "
                   "another stream)" if state.get("version") == 1 else "")
            raise DataError(f"loader state version {state.get('version')} is not {STATE_VERSION}{why}; "
                            f"resume from consumed_sequences alone or start the data stream afresh")
        if state["tokenizer_hash"] != thash:
            raise TokenizerMismatchError(f"loader state was made with tokenizer {state['tokenizer_hash']}, "
                                         f"configured tokenizer {cfg.tokenizer} is {thash}")
        if state["seed"] != seed:
            raise DataError(f"loader state has seed {state['seed']}, data.seed is {seed}")
        # Source order defines the stream; stored as a list because JSON writers may sort dict keys.
        state_names = state.get("sources", list(state["per_source_consumed"]))
        if state_names != names:
            raise DataError(f"loader state sources {state_names} != data.sources {names}")
        sw = [state["weights"][n] for n in names]
        if not np.allclose(sw, weights, rtol=0, atol=1e-9):
            raise DataError(f"loader state weights {state['weights']} != the sources' weights "
                            f"{dict(zip(names, weights))}")
        if state.get("weight_by") != cfg.weight_by:
            raise DataError(f"loader state has weight_by {state.get('weight_by')!r}, the mix's weight_by is "
                            f"{cfg.weight_by!r}: the mix differs")
        st_split = state.get("split", "train")  # states from before the split: train, nothing held out
        if st_split != split:
            raise DataError(f"loader state is for the {st_split!r} split, this loader reads the {split!r} split")
        st_held = state.get("valid_documents", {n: 0 for n in names})
        if [st_held.get(n) for n in names] != held_out:
            raise DataError(f"loader state was saved with valid_documents (held-out documents per source) "
                            f"{st_held}; valid_documents={cfg.valid_documents!r} now holds out "
                            f"{dict(zip(names, held_out))}: the train/valid split differs")
        if consumed_sequences not in (0, state["consumed_sequences"]):
            raise DataError(f"consumed_sequences={consumed_sequences} contradicts the state's "
                            f"{state['consumed_sequences']}")
        if state["seq_length"] != S:
            log.warning("seq_length changed %d -> %d: continuing at token position %d",
                        state["seq_length"], S, state["token_position"])
        cursor = {
            "consumed_sequences": int(state["consumed_sequences"]),
            "token_position": int(state["token_position"]),
            "doc_index": int(state["doc_index"]),
            "doc_offset": int(state["doc_offset"]),
            "per_source": [int(state["per_source_consumed"][n]) for n in names],
        }
    else:
        pos = consumed_sequences * S
        planner = Planner(datasets, weights, seed, held_out=held_out, split=split, weight_by=cfg.weight_by)
        planner.reset()
        loc = planner.locate(pos)
        cursor = {
            "consumed_sequences": int(consumed_sequences),
            "token_position": int(pos),
            "doc_index": loc["doc_index"],
            "doc_offset": loc["doc_offset"],
            "per_source": [int(x) for x in loc["per_source"]],
        }
    spec = _Spec(datasets, weights, seed, S, sp.eos_id(), cfg.allow_skip_corrupt,
                 micro_batch_size, global_batch_size, dp_rank, dp_size, cursor, held_out, split, cfg.weight_by)
    return TokenLoader(spec, cfg.num_workers, thash, names, stats)


def held_out_documents(cfg: DataConfig, datasets: list[Dataset]) -> list[int]:
    """Per source, how many documents the split holds out: the last that many sample ids of its index.

    Depends only on ``valid_documents`` and each index's ``num_samples`` (not on which shards are
    usable), so every rank, worker and resume agrees."""
    out = []
    for s, ds in zip(cfg.sources, datasets):
        n = int(ds.index["num_samples"])
        if cfg.valid_documents is None:
            out.append(auto_valid_documents(n))
            continue
        if cfg.valid_documents >= n:
            raise DataError(f"valid_documents={cfg.valid_documents} would hold out every document of "
                            f"source '{s.name}' ({n} documents, {ds.path}); it must be smaller than each "
                            f"source's document count")
        out.append(int(cfg.valid_documents))
    return out


def planner_for(cfg: DataConfig, split: str = "train", *, datasets: list[Dataset] | None = None) -> Planner:
    """The planner of ``split``'s stream as :func:`build_loader` defines it (inspection and tests)."""
    if datasets is None:
        datasets = [Dataset.load(s.path, allow_skip_corrupt=cfg.allow_skip_corrupt) for s in cfg.sources]
    return Planner(datasets, cfg.weights, cfg.seed, held_out=held_out_documents(cfg, datasets), split=split,
                   weight_by=cfg.weight_by)
