"""The model as generation builds it: the training model's class and weights, Megatron's *local*
(torch) layers.

Why the local layers: decoding feeds Megatron's attention a per-sequence padding mask and a
per-sequence rotary table through its static KV cache (``StaticInferenceContext``). Megatron's own
``DotProductAttention`` applies any boolean mask it is given; the fused causal softmax kernel (GPU)
and Transformer Engine's attention switch to "no mask" once the cache is past the prompt and would
attend to padding. Checkpoints are keyed by ``sharded_state_dict`` keys, which the local spec maps to
the Transformer-Engine names, so a TE-trained checkpoint loads into these layers.
"""

from __future__ import annotations

import torch

from fbt_megatron import runtime
from fbt_megatron.config import FeedbackConfig, ModelConfig
from fbt_megatron.model.fbt_gpt import FBTGPTModel, transformer_config


def build_inference_model(model: ModelConfig, feedback: FeedbackConfig) -> FBTGPTModel:
    from megatron.core.models.gpt import gpt_layer_specs

    config = transformer_config(model, sequence_parallel=False)
    config.masked_softmax_fusion = False  # the fused causal kernel ignores an explicit padding mask
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=model.normalization)
    return FBTGPTModel(model, feedback, config, spec=spec).to(runtime.device()).eval()


@torch.no_grad()
def full_vocab_logits(model: FBTGPTModel, top: torch.Tensor) -> torch.Tensor:
    """[S, B, D] top states -> [B, S, V] logits over the logical vocabulary (V = ``vocab_size``),
    gathered over tensor parallelism. The TP-dependent padding columns are cut off, not only masked:
    a sampler's random draws depend on the width of the vector it samples from, so TP=1 and TP=2
    would otherwise draw different tokens from the same distribution."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    logits = gather_from_tensor_model_parallel_region(model.head(top))
    return logits[..., : model.model_config.vocab_size].float()
