"""Synthetic tasks for the layer-0 probes, each a pure function of a numpy Generator.

Both tasks return ``input_ids`` [B, S], training ``labels`` [B, S] with a ``loss_mask``, and the
probe's target per position (``probe`` [B, S], ``-1`` where undefined).

*Completion tracking*: a row is a chain of sub-tasks; each starts with a count token ``n`` (1..max)
followed by ``n`` item tokens. The model is trained on next-token prediction, which needs completion
tracking: after the last item the next token is a count, otherwise an item. The probe target at t is
"the sub-task is complete after token t" — it depends on the count seen earlier, not only on x_t, so
a standard model's layer 0 (token embedding only) can do no better than the majority class.

*Delayed memory*: random tokens; the model is trained to output, at every position t >= d, the token
seen d steps back (``labels[t] = x[t-d]``). Probe targets: the current answer x[t-d] and the previous
position's answer x[t-1-d] (what the top layer computed one step earlier). x_t is independent of
both, so a standard model's layer 0 is at chance (1 / num_symbols).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TaskBatch:
    input_ids: np.ndarray  # [B, S] int64
    labels: np.ndarray  # [B, S] int64 (0 where loss_mask is 0)
    loss_mask: np.ndarray  # [B, S] float32
    probes: dict[str, np.ndarray]  # name -> [B, S] int64 targets, -1 where undefined
    vocab_size: int


def completion_vocab(max_count: int, num_items: int) -> int:
    return 1 + max_count + num_items  # 0 is unused, 1..max_count counts, then items


def completion_task(rng: np.random.Generator, batch: int, seq_len: int, *, max_count: int = 4,
                    num_items: int = 8) -> TaskBatch:
    """Chains of (count n, n items); next-token labels; probe ``complete`` (1 = sub-task done after t)."""
    n_tok = seq_len + 1
    ids = np.zeros((batch, n_tok), dtype=np.int64)
    complete = np.zeros((batch, n_tok), dtype=np.int64)
    for b in range(batch):
        t = 0
        while t < n_tok:
            n = int(rng.integers(1, max_count + 1))
            ids[b, t] = n
            t += 1
            for i in range(n):
                if t >= n_tok:
                    break
                ids[b, t] = 1 + max_count + int(rng.integers(0, num_items))
                complete[b, t] = int(i == n - 1)
                t += 1
    return TaskBatch(input_ids=ids[:, :-1], labels=ids[:, 1:].copy(),
                     loss_mask=np.ones((batch, seq_len), dtype=np.float32),
                     probes={"complete": complete[:, :-1]}, vocab_size=completion_vocab(max_count, num_items))


def delayed_memory_task(rng: np.random.Generator, batch: int, seq_len: int, *, delay: int = 4,
                        num_symbols: int = 16) -> TaskBatch:
    """Random symbols; labels[t] = x[t-delay]; probes ``recall`` (x[t-d]) and ``recall_prev`` (x[t-1-d])."""
    if not 1 <= delay < seq_len - 1:
        raise ValueError(f"delay={delay} must be in [1, seq_len-1) for seq_len={seq_len}")
    ids = rng.integers(0, num_symbols, size=(batch, seq_len)).astype(np.int64)
    labels = np.zeros_like(ids)
    labels[:, delay:] = ids[:, :-delay]
    mask = np.zeros((batch, seq_len), dtype=np.float32)
    mask[:, delay:] = 1.0
    recall = np.full_like(ids, -1)
    recall[:, delay:] = ids[:, :-delay]
    prev = np.full_like(ids, -1)
    prev[:, delay + 1:] = ids[:, : -(delay + 1)]
    return TaskBatch(input_ids=ids, labels=labels, loss_mask=mask,
                     probes={"recall": recall, "recall_prev": prev}, vocab_size=num_symbols)


TASKS = {"completion": completion_task, "delayed_memory": delayed_memory_task}
