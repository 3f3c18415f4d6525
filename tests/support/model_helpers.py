"""Shared builders for the model tests: a tiny config, deterministic inputs, TP (un)sharding."""

import torch
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from fbt_megatron.config import FeedbackConfig, ModelConfig
from fbt_megatron.model import tp_layout

# vocab_pad_multiple=32: 64 rows at TP 1 and 2 (no padded rows; padding is tested with the Llama config)
TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=32,
            vocab_pad_multiple=32)
# Llama-shaped: SwiGLU, RMSNorm, grouped-query attention (2 KV heads for 4 query heads), no biases,
# untied embeddings, a non-default RoPE base; the vocabulary (64) is padded (to 128, or 256 at TP=2).
LLAMA = dict(TINY, activation="swiglu", ffn_hidden_size=48, normalization="RMSNorm", num_query_groups=2,
             add_bias_linear=False, tie_embeddings=False, rotary_base=500000, vocab_pad_multiple=128)  # padded


def tiny_model_config(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides})


def make_inputs(batch=2, seq=10, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    doc_start = torch.zeros(batch, seq, dtype=torch.bool)
    doc_start[0, 4] = True  # packed documents: two in row 0, three in row 1
    doc_start[1, 3] = doc_start[1, 7] = True
    return ids, labels, doc_start


def loss_and_grads(model, num_passes: int):
    """The summed token loss of one forward and backward on :func:`make_inputs` (12 positions, the
    jitter drawn alike in every call), and the gradient of every parameter that got one."""
    ids, labels, doc_start = make_inputs(seq=12)
    model.zero_grad(set_to_none=True)
    loss = model(ids, doc_start=doc_start, labels=labels, num_passes=num_passes, jitter_seed=7).token_loss.sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def shard(full: torch.Tensor, param, name: str = "", model=None) -> torch.Tensor:
    """The slice of a TP=1 tensor that this rank's TP-sharded parameter holds."""
    return tp_layout.to_local(name, full, param, model)


def unshard(local: torch.Tensor, param, name: str = "", model=None) -> torch.Tensor:
    """The full (TP=1, logical-vocabulary) tensor from every TP rank's slice of a parameter (or grad)."""
    return tp_layout.to_full(name, local, param, model)


def load_full_weights(model, full_state: dict) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(shard(full_state[name], p, name, model))


def gathered_logits(logits: torch.Tensor) -> torch.Tensor:
    return gather_from_tensor_model_parallel_region(logits)


def feedback(**overrides) -> FeedbackConfig:
    return FeedbackConfig(**overrides)
