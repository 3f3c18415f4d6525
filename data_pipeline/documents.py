"""Where a micro-batch's documents lie once its rows are laid end to end: the ``cu_seqlens`` and
``max_seqlen`` of packed (THD) attention, made on the host with the batch so that the device path needs
no ``nonzero`` or ``max`` (each a host sync) per micro-batch and stage."""

from __future__ import annotations

import torch


def packed_documents(doc_start: torch.Tensor) -> tuple[torch.Tensor, int]:
    """[B, S] document-start flags -> (``cu_seqlens`` int32 [n + 1], ``max_seqlen``) of the B rows laid end
    to end (row b at b*S .. b*S+S-1): each row starts a sequence whatever its flags say, a document split
    across rows is two sequences, and tokens after a row's last start belong to that last document."""
    rows, seq = doc_start.shape
    starts = doc_start.reshape(-1).to(torch.bool).clone()
    starts[::seq] = True
    bounds = torch.cat([starts.nonzero().flatten(), torch.tensor([rows * seq])])
    return bounds.to(torch.int32), int((bounds[1:] - bounds[:-1]).max())


def with_packed_documents(batch: dict) -> dict:
    """``batch`` with ``cu_seqlens`` and ``max_seqlen`` from its ``doc_start`` (as they are when present)."""
    if "cu_seqlens" in batch or "doc_start" not in batch:
        return batch
    cu, longest = packed_documents(batch["doc_start"])
    return {**batch, "cu_seqlens": cu, "max_seqlen": longest}
