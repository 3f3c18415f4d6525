"""The exact recurrence over rows of packed documents, through the decoder's KV cache.

Under ``document_causal`` attention a row's documents are independent: each attends only to itself, its
positions start at 0 and its fed-back state starts afresh. So the exact recurrence of a row is that of
each document decoded alone, a token at a time (:class:`~fbt_megatron.generate.decoder.FeedbackDecoder`'s
``"exact"`` prefill). That costs one pass of compute, where ``num_passes = S`` Jacobi passes cost S.
"""

from __future__ import annotations

import torch

from data_pipeline.documents import packed_documents
from fbt_megatron.generate.decoder import FeedbackDecoder
from fbt_megatron.model.fbt_gpt import FBTGPTModel


def documents(doc_start: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of every document of ``doc_start`` [B, S] (True at a document's first
    token; a row's first token always starts one): the packed bounds of ``data_pipeline.documents``, per row."""
    rows, seq = doc_start.shape
    if rows * seq == 0:
        return []
    bounds = packed_documents(doc_start.cpu())[0].tolist()
    return [(a // seq, a % seq, b - a // seq * seq) for a, b in zip(bounds, bounds[1:])]


LOGITS_AT_ONCE = 2 ** 27  # logits held at once (512 MiB of float32): the rows decoded together, a session's documents


@torch.no_grad()
def document_recurrence_logits(model: FBTGPTModel, input_ids: torch.Tensor, doc_start: torch.Tensor | None = None,
                               documents_at_once: int = 256) -> torch.Tensor:
    """Logits [B, S, V] (the logical vocabulary) of the exact recurrence over ``input_ids`` [B, S], each
    document (``doc_start``; None: one a row) decoded alone, up to ``documents_at_once`` in a session
    (fewer where their logits would pass :data:`LOGITS_AT_ONCE`), documents of like length together."""
    if model.feedback is None:
        raise ValueError("feedback.fusion='off' has no recurrence to run")
    if model.model_config.attention_mask != "document_causal":
        raise ValueError("the exact recurrence document by document needs attention_mask='document_causal' "
                         "(under 'causal' a document attends to the ones before it in its row)")
    rows, seq = input_ids.shape
    vocab = model.model_config.vocab_size
    if doc_start is None:
        doc_start = torch.zeros(rows, seq, dtype=torch.bool)
    docs = sorted(documents(doc_start), key=lambda d: d[2] - d[1])  # a session as wide as its longest document
    ids = input_ids.cpu().tolist()
    decoder = FeedbackDecoder(model, "feedback", "exact")
    out = torch.empty(rows, seq, vocab)
    i = 0
    while i < len(docs):
        n = 1
        while (i + n < len(docs) and n < documents_at_once
               and (n + 1) * (docs[i + n][2] - docs[i + n][1]) * vocab <= LOGITS_AT_ONCE):
            n += 1
        chunk, i = docs[i:i + n], i + n
        session = decoder.session([ids[r][a:b] for r, a, b in chunk], 0, padding="right")
        _, every = session.prefill(return_all=True)  # [n, W, V]: right padding, a document's tokens first
        for j, (r, a, b) in enumerate(chunk):
            out[r, a:b] = every[j, :b - a].cpu()
    return out


@torch.no_grad()
def exact_recurrence_loss(model: FBTGPTModel, batches: list[dict], rows_at_once: int | None = None) -> float:
    """The token-weighted mean cross entropy of the exact recurrence over ``batches`` (``input_ids``,
    ``labels``, ``loss_mask``, ``doc_start``), as validation weighs it. The rows of consecutive batches of
    one width are decoded together, about ``rows_at_once`` at a time (None: as many as
    :data:`LOGITS_AT_ONCE` holds the logits of): a decoding step costs much the same for one document as
    for a hundred at small sizes, so fewer, wider steps."""
    total = weight = 0.0
    group: list[dict] = []

    def decode(group: list[dict]) -> None:
        nonlocal total, weight
        ids = torch.cat([b["input_ids"].cpu() for b in group])
        starts = torch.cat([b["doc_start"].cpu() if b.get("doc_start") is not None
                            else torch.zeros(b["input_ids"].shape, dtype=torch.bool) for b in group])
        logits = document_recurrence_logits(model, ids, starts)
        row = 0
        for b in group:  # the loss batch by batch: log-probabilities in float64 for one batch at a time
            n = b["input_ids"].shape[0]
            logp = torch.log_softmax(logits[row:row + n].double(), dim=-1)
            nll = -logp.gather(-1, b["labels"].cpu().long().unsqueeze(-1)).squeeze(-1)
            mask = b["loss_mask"].cpu().double()
            total += float((nll * mask).sum())
            weight += float(mask.sum())
            row += n

    for batch in batches:
        width = batch["input_ids"].shape[1]
        limit = rows_at_once or max(1, LOGITS_AT_ONCE // (width * model.model_config.vocab_size))
        if group and (group[0]["input_ids"].shape[1] != width
                      or sum(b["input_ids"].shape[0] for b in group) + batch["input_ids"].shape[0] > limit):
            decode(group)
            group = []
        group.append(batch)
    if group:
        decode(group)
    return total / max(weight, 1.0)
