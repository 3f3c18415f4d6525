"""A deterministic synthetic token source with the data pipeline's batch interface.

Sequence ``i`` of the stream is a pure function of ``(seed, i)``, so the global batch of step ``s``
is the same whatever the data-parallel size: step ``s`` consumes sequences
``[s * global_batch, (s + 1) * global_batch)``; DP rank ``r`` of ``d`` takes the contiguous block
``[r * G/d, (r + 1) * G/d)`` of it, cut into micro-batches of ``micro_batch_size`` in order (the data
pipeline's convention, so global micro-batch ``r * (G/d/B) + j`` is the same data for every layout). The only state is the global
count of consumed sequences, which is why a run can resume under another DP size.

The text is learnable but not trivial: documents of random length, each following a random affine
recurrence ``t[j+1] = (a * t[j] + b) mod V`` with occasional noise tokens, so a model that reads the
context (and an FBT model that carries state) can lower the loss well below ``log V``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import torch

from data_pipeline.documents import with_packed_documents
from fbt_megatron.config import SyntheticDataConfig


def make_sequence(cfg: SyntheticDataConfig, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens [S+1] and document-start flags [S+1] of global sequence ``index``."""
    rng = np.random.Generator(np.random.Philox(key=cfg.seed, counter=[0, 0, 1, index]))
    n, v = cfg.seq_length + 1, cfg.vocab_size
    tokens = np.empty(n, dtype=np.int64)
    starts = np.zeros(n, dtype=bool)
    j = 0
    while j < n:
        length = int(rng.integers(2, 2 * cfg.mean_doc_length))
        a, b = int(rng.integers(1, 8)), int(rng.integers(0, v))
        t = int(rng.integers(0, v))
        starts[j] = True
        for _ in range(min(length, n - j)):
            tokens[j] = t
            t = (a * t + b) % v if rng.random() >= cfg.noise else int(rng.integers(0, v))
            j += 1
    return tokens, starts


def group_table(cfg: SyntheticDataConfig) -> np.ndarray:
    """[order, order] product table of the state-tracking group: ``table[a, b]`` is the element a * b
    (cyclic: (a + b) mod n; symmetric: the permutation a after b, elements in lexicographic order)."""
    if cfg.group == "cyclic":
        n = cfg.group_size
        return (np.arange(n)[:, None] + np.arange(n)[None, :]) % n
    perms = list(itertools.permutations(range(cfg.group_size)))
    index = {p: i for i, p in enumerate(perms)}
    return np.array([[index[tuple(a[j] for j in b)] for b in perms] for a in perms], dtype=np.int64)


def state_tracking_batch(cfg: SyntheticDataConfig, indices) -> dict[str, torch.Tensor]:
    """Rows of uniform group elements x_1..x_S, each labelled with the running product
    x_t * ... * x_1 (position t needs all t inputs: t composed steps). One problem per row."""
    table = group_table(cfg)
    rows = []
    for i in indices:
        rng = np.random.Generator(np.random.Philox(key=cfg.seed, counter=[0, 0, 2, int(i)]))
        x = rng.integers(0, len(table), size=cfg.seq_length)
        state, labels = 0, np.empty_like(x)  # element 0 is the identity (0; the identity permutation)
        for t, g in enumerate(x):
            state = table[g, state]
            labels[t] = state
        rows.append((x, labels))
    input_ids = torch.from_numpy(np.stack([r[0] for r in rows]))
    labels = torch.from_numpy(np.stack([r[1] for r in rows]))
    doc_start = torch.zeros_like(input_ids, dtype=torch.bool)
    doc_start[:, 0] = True
    return with_packed_documents(dict(input_ids=input_ids, labels=labels, loss_mask=torch.ones(input_ids.shape),
                                      position_ids=torch.arange(cfg.seq_length).expand_as(input_ids).clone(),
                                      doc_start=doc_start))


def make_batch(cfg: SyntheticDataConfig, indices) -> dict[str, torch.Tensor]:
    if cfg.task == "state_tracking":
        return state_tracking_batch(cfg, indices)
    seqs = [make_sequence(cfg, int(i)) for i in indices]
    tokens = torch.from_numpy(np.stack([s[0] for s in seqs]))
    starts = torch.from_numpy(np.stack([s[1] for s in seqs]))
    input_ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    doc_start = starts[:, :-1].clone()
    doc_start[:, 0] = True
    # Position ids restart at every document start.
    s = input_ids.shape[1]
    ar = torch.arange(s).expand_as(input_ids)
    last_start = torch.where(doc_start, ar, torch.zeros_like(ar)).cummax(dim=1).values
    position_ids = ar - last_start
    # No loss on the first token of a document: it is not predictable from the previous one.
    loss_mask = (~starts[:, 1:]).to(torch.float32)
    return with_packed_documents(dict(input_ids=input_ids, labels=labels, loss_mask=loss_mask,
                                      position_ids=position_ids, doc_start=doc_start))


class SyntheticLoader:  # same constructor keywords as data_pipeline.loader.build_loader
    """Yields this DP rank's micro-batches, step after step, from a global sequence cursor."""

    def __init__(self, cfg: SyntheticDataConfig, *, micro_batch_size: int, global_batch_size: int,
                 dp_rank: int, dp_size: int, consumed_sequences: int = 0, offset: int = 0):
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(
                f"global batch {global_batch_size} is not divisible by micro batch {micro_batch_size} "
                f"x data-parallel size {dp_size}")
        self.cfg, self.mbs, self.gbs = cfg, micro_batch_size, global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_sequences = consumed_sequences
        self.offset = offset  # validation streams live far from the training stream

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            base = self.offset + self.consumed_sequences
            per_rank = self.gbs // self.dp_size
            for j in range(per_rank // self.mbs):
                start = base + self.dp_rank * per_rank + j * self.mbs
                yield make_batch(self.cfg, range(start, start + self.mbs))
            self.consumed_sequences += self.gbs

    def state_dict(self) -> dict:
        return {"consumed_sequences": self.consumed_sequences}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_sequences = int(state["consumed_sequences"])
