"""Shared builders for the model tests: a tiny config, deterministic inputs, TP (un)sharding."""

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from fbt_megatron.config import FeedbackConfig, ModelConfig

TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=32)


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


def shard(full: torch.Tensor, param) -> torch.Tensor:
    """The slice of a TP=1 tensor that this rank's TP-sharded parameter holds."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    return full.chunk(tp, dim=param.partition_dim)[rank].contiguous()


def unshard(local: torch.Tensor, param) -> torch.Tensor:
    """The full tensor from every TP rank's slice of a TP-sharded parameter (or grad)."""
    if not getattr(param, "tensor_model_parallel", False):
        return local
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(tp)]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)


def load_full_weights(model, full_state: dict) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(shard(full_state[name], p))


def gathered_logits(logits: torch.Tensor) -> torch.Tensor:
    return gather_from_tensor_model_parallel_region(logits)


def feedback(**overrides) -> FeedbackConfig:
    return FeedbackConfig(**overrides)
