"""The MFU that training prints counts attention as it runs: document-causal packed attention attends
d(d+1)/2 (query, key) pairs per document, not the row's full square. Counts are written by hand."""

import types

import torch

from fbt_megatron.recipe import load_recipe
from fbt_megatron.train.callbacks import ConsoleLogger, attention_flops_per_pair, causal_pairs
from fbt_megatron.train.run import _flops_fn
from fbt_megatron.train.train_step import FBTTrainStep, StepResult


def packed_batch() -> dict:
    """Two rows of 8: row 0 holds documents of 3 and 5 tokens, row 1 one of 8."""
    from data_pipeline.documents import with_packed_documents

    doc_start = torch.zeros(2, 8, dtype=torch.bool)
    doc_start[0, 3] = True
    return with_packed_documents({"input_ids": torch.zeros(2, 8, dtype=torch.long), "doc_start": doc_start})


def test_pairs_of_a_packed_batch_by_hand():
    batch = packed_batch()
    assert causal_pairs(batch["cu_seqlens"].tolist()) == 6 + 15 + 36  # 3*4/2 + 5*6/2 + 8*9/2
    document = FBTTrainStep._attention_pairs(types.SimpleNamespace(attention_mask="document_causal"), batch)
    row = FBTTrainStep._attention_pairs(types.SimpleNamespace(attention_mask="causal"), batch)
    assert (document, row) == (57, 2 * 36)  # causal over the row: 8*9/2 per row


def test_step_flops_count_causal_attention_per_document():
    """3 x (2 N_mm per token + 4 L h per attended pair) for a one-pass step (forward + backward 2x), with
    L=4, h=128 (recipes/tiny.yaml): 57 pairs, where the full-square count had 16 tokens x 8 keys = 128."""
    recipe = load_recipe("recipes/tiny.yaml", ["feedback.fusion=off", "model.tie_embeddings=true",
                                               "model.position_embedding_type=rope"])
    n_mm = 1_000_000  # no lookups, no fusion: every parameter takes part in a matmul
    flops = _flops_fn(recipe, n_mm)
    r = StepResult(step=1, num_passes=1, loss=1.0, tokens=16, skipped=False, grad_norm=1.0, lr=1e-3,
                   seconds=2.0, attention_pairs=57)
    assert flops(r) == 3 * (2 * n_mm * 16 + 4 * 4 * 128 * 57)
    three = StepResult(**{**r.__dict__, "num_passes": 3})
    assert flops(three) == 9 * (2 * n_mm * 16 + 4 * 4 * 128 * 57)  # grad_mode all: 3 forwards, 3 backwards
    assert attention_flops_per_pair(4, 128, 3, "last") == 5 * 4 * 4 * 128  # 3 forwards + 1 backward (2F)

    lines = []
    logger = ConsoleLogger(1, flops, peak_flops=1e9, world_size=2, print_fn=lambda line, **kw: lines.append(line))
    trainer = types.SimpleNamespace(state=types.SimpleNamespace(step=1, pass_counts={1: 1}, skipped_steps=0),
                                    total_steps=1, metrics={})
    logger.on_step_end(trainer, r)
    mfu = 100 * flops(r) / 2.0 / (1e9 * 2)
    assert f"MFU {mfu:.2f}% (causal attention)" in lines[0]
