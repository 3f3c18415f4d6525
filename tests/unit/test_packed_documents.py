"""A micro-batch's packed documents (``cu_seqlens``, ``max_seqlen``) are made by the loader on the host, and
the packed attention path takes them as given: no ``nonzero`` or ``max`` read back from the device per
micro-batch and stage. References are written from the definition: the offsets of the documents of the
rows laid end to end, each row starting one."""

import numpy as np
import pytest
import torch

from data_pipeline.documents import packed_documents
from tests.support.model_helpers import LLAMA, feedback, make_inputs, tiny_model_config


def documents_by_hand(doc_start: torch.Tensor) -> tuple[list[int], int]:
    rows, seq = doc_start.shape
    bounds = []
    for r in range(rows):
        for t in range(seq):
            if t == 0 or bool(doc_start[r, t]):
                bounds.append(r * seq + t)
    bounds.append(rows * seq)
    return bounds, max(b - a for a, b in zip(bounds, bounds[1:]))


def test_packed_documents_by_hand():
    doc_start = torch.zeros(3, 6, dtype=torch.bool)
    doc_start[0, 2] = True  # row 1 has no start: row 0's document runs on, split at the row boundary
    doc_start[2, 0] = doc_start[2, 3] = True
    cu, longest = packed_documents(doc_start)
    assert cu.tolist() == [0, 2, 6, 12, 15, 18] and cu.dtype == torch.int32 and longest == 6
    assert isinstance(longest, int)


def test_the_pipeline_loader_makes_them_with_the_batch():
    from data_pipeline.loader import expand

    rng = np.random.default_rng(0)
    m, seq = 3, 8
    start = rng.random(m * seq + 1) < 0.2
    compact = {"m": m, "S": seq, "tokens": rng.integers(3, 50, m * seq + 1), "start": start, "bad": None,
               "target": None, "eos": 2}
    batch = expand(compact)
    bounds, longest = documents_by_hand(batch["doc_start"])
    assert batch["cu_seqlens"].tolist() == bounds and batch["max_seqlen"] == longest
    assert batch["cu_seqlens"].device.type == "cpu"


def test_the_synthetic_loader_makes_them_with_the_batch():
    from fbt_megatron.config import SyntheticDataConfig
    from fbt_megatron.data.synthetic import make_batch

    batch = make_batch(SyntheticDataConfig(seq_length=32), range(3))
    assert batch["doc_start"][:, 1:].any()  # several documents in a row
    bounds, longest = documents_by_hand(batch["doc_start"])
    assert batch["cu_seqlens"].tolist() == bounds and batch["max_seqlen"] == longest


def test_the_packed_path_takes_the_loaders_documents_and_derives_none(single_process, monkeypatch):
    """Given the loader's documents the model computes no ``cu_seqlens`` (no ``nonzero``, no ``max`` of device
    values); the loss, top states and gradients are those of the path that derives them."""
    from fbt_megatron.model import fbt_gpt
    from fbt_megatron.model.fbt_gpt import build_model

    config = tiny_model_config(**LLAMA)
    ids, labels, doc_start = make_inputs(seq=10)
    torch.manual_seed(0)
    model = build_model(config, feedback(), packed=True).train()

    def run(**documents):  # the same weights each time: no optimiser step between the runs
        model.zero_grad(set_to_none=True)
        out = model(ids, doc_start=doc_start, labels=labels, num_passes=2, jitter_seed=7, **documents)
        out.token_loss.sum().backward()
        return out.token_loss.detach(), out.hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                             if p.grad is not None}

    derived = run()
    cu, longest = packed_documents(doc_start)

    def refuse(*args, **kwargs):
        raise AssertionError("the packed path derived cu_seqlens on the device")

    monkeypatch.setattr(fbt_gpt, "packed_seq_params", refuse)
    given = run(cu_seqlens=cu, max_seqlen=longest)
    torch.testing.assert_close(given[0], derived[0], rtol=0, atol=0)
    torch.testing.assert_close(given[1], derived[1], rtol=0, atol=0)
    assert given[2].keys() == derived[2].keys()
    for name in derived[2]:
        torch.testing.assert_close(given[2][name], derived[2][name], rtol=0, atol=0)
    with pytest.raises(AssertionError, match="derived cu_seqlens"):
        run()  # without the loader's documents the model still derives them
