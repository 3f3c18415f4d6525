"""Latent feedback: the one new layer of a full-bandwidth transformer.

A standard decoder turns its top-layer state into one sampled token and drops the state. Here the
previous position's top state h_{t-1} comes back to the bottom of the stack, fused with the current
token embedding e_t by a gated linear unit:

    x_t = (W_U h_{t-1}) * sigmoid(W_G e_t)          (fusion="glu", the paper's)

The state rides the value path and the token is only a multiplicative gate: with a symmetric additive
fusion (``additive``: x_t = W_U h_{t-1} + W_G e_t, kept for ablation) the model can learn to ignore
the state. ``off`` gives a standard GPT (x_t = e_t, no extra weights).

Which state is fed back: the *final-layernorm output* of the top layer (exactly what the LM head
reads). It is normalised, so its scale does not grow with depth or passes, which keeps the
pass-to-pass map well conditioned.

Tensor parallelism: W_U and W_G are Megatron ColumnParallelLinear layers (each rank holds D/TP output
rows of both), the product is formed on the local slice and gathered back to [S, B, D]. With sequence
parallelism the local slice is redistributed to the sequence-parallel layout by an all-to-all instead.

Stabilisers (switches in FeedbackConfig; our documented reading of the paper, see docs/feedback.md):
- prefix mixin a: the fed-back state is (1-a) h + a h_init, a pull toward the learned initial state
  (the state every prefix starts from) that shrinks the map's Lipschitz constant by (1-a);
- depth scaling: W_U starts at std / sqrt(2 * num_layers), like Megatron's residual-output init, so
  early in the feedback phase the fed-back value is a small perturbation;
- weight tying: input embedding and LM head share weights (ModelConfig.tie_embeddings), so fed-back
  states and token embeddings live in one space;
- jitter: N(0, jitter_std^2) noise on the fed-back state, training only, drawn from a generator
  seeded by the caller so it is reproducible on resume and identical on all TP ranks.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule

from fbt_megatron.config import FeedbackConfig


class LatentFeedback(MegatronModule):
    def __init__(self, config: TransformerConfig, feedback: FeedbackConfig):
        super().__init__(config)
        self.feedback = feedback
        self.mode = feedback.fusion
        self.sequence_parallel = config.sequence_parallel
        hidden = config.hidden_size
        # The fusion sees full-sequence inputs (the shift crosses sequence-parallel chunks), so its
        # linears are built without sequence parallelism; the output is redistributed explicitly.
        linear_config = replace(config, sequence_parallel=False)
        std = config.init_method_std
        value_std = std / math.sqrt(2.0 * config.num_layers) if feedback.depth_scaling else std

        def linear(init_std):
            return tensor_parallel.ColumnParallelLinear(
                hidden, hidden, config=linear_config, bias=feedback.bias, gather_output=False,
                init_method=lambda w: torch.nn.init.normal_(w, 0.0, init_std),
            )

        self.value = linear(value_std)  # W_U: acts on the fed-back state
        self.gate = linear(std)  # W_G: acts on the token embedding
        # h_init: the state at position 0 and at every document start. Unit scale, like a
        # final-layernorm output; zero would make the glu input vanish.
        self.initial_state = torch.nn.Parameter(torch.empty(hidden, dtype=config.params_dtype))
        with torch.no_grad():
            self.initial_state.normal_(0.0, 1.0)

    # ----------------------------------------------------------------- the recurrence's pieces
    def fed_back(self, top_state: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """What of h_{t-1} reaches position t: prefix mixin, then jitter (training only)."""
        a = self.feedback.prefix_mixin
        state = (1.0 - a) * top_state + a * self.initial_state if a else top_state
        if self.training and self.feedback.jitter_std > 0:
            noise = torch.randn(state.shape, generator=generator, device=state.device, dtype=state.dtype)
            state = state + self.feedback.jitter_std * noise
        return state

    def initial_states(self) -> torch.Tensor:
        """Pass 1's state: h_init at every position, as a broadcastable [1, 1, D] (the value
        projection of a constant is then computed once, not once per token)."""
        return self.initial_state.view(1, 1, -1)

    def shift_states(self, top_state: torch.Tensor, reset: torch.Tensor, generator=None) -> torch.Tensor:
        """[S, B, D] top states of the previous pass -> the state each position receives.

        Position t gets the fed-back h_{t-1}; positions where ``reset`` [S, B] is True (position 0
        and every document start) get h_init instead, never the previous document's state.
        """
        fed = self.fed_back(top_state, generator)
        shifted = torch.cat([self.initial_state.expand_as(fed[:1]), fed[:-1]], dim=0)
        return torch.where(reset.unsqueeze(-1), self.initial_state.to(shifted.dtype), shifted)

    def forward(self, state: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """Fuse states [S, B, D] (or a broadcastable [1, 1, D]) with token embeddings [S, B, D].

        Returns [S, B, D], or [S/TP, B, D] under sequence parallelism.
        """
        return self.fuse(state, self.token_gate(embedded))

    def token_gate(self, embedded: torch.Tensor) -> torch.Tensor:
        """The token path [S, B, D/TP]: sigmoid(W_G e) for glu, W_G e for additive. It does not
        depend on the fed-back state, so a k-pass forward computes it once and reuses it."""
        gate, _ = self.gate(embedded)
        return torch.sigmoid(gate) if self.mode == "glu" else gate

    def fuse(self, state: torch.Tensor, token_gate: torch.Tensor) -> torch.Tensor:
        """Fuse states with a precomputed :meth:`token_gate`; same output as :meth:`forward`."""
        value, _ = self.value(state)
        local = value * token_gate if self.mode == "glu" else value + token_gate
        local = local.expand(token_gate.shape)  # [1, 1, D/TP] value from a constant state
        if self.sequence_parallel:  # [S*B, D/TP] -> [S*B/TP, D]: tokens are sequence-major
            seq, batch, _ = local.shape
            tokens = tensor_parallel.all_to_all_hp2sp(local.reshape(seq * batch, -1))
            return tokens.view(-1, batch, tokens.shape[-1])
        return tensor_parallel.gather_from_tensor_model_parallel_region(local)
