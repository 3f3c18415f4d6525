"""Latent feedback: the one new layer of a full-bandwidth transformer, and the rule for what each
pass feeds the bottom of the stack.

A standard decoder turns its top-layer state into one sampled token and drops the state. Here the
previous position's top state h_{t-1} comes back to the bottom of the stack, fused with the current
token embedding e_t by a gated linear unit:

    x_t = (W_U h_{t-1}) * sigmoid(W_G e_t)          (fusion="glu", the paper's)

The state rides the value path and the token is only a multiplicative gate: with a symmetric additive
fusion (``additive``: x_t = W_U h_{t-1} + W_G e_t, kept for ablation) the model can learn to ignore
the state. ``off`` gives a standard GPT (x_t = e_t, no extra weights).

The rule itself (shift, reset, mix, fuse, the stack input) is plain torch functions in
``model/feedback_rule.py``, shared with the Hugging Face export and the vLLM plugin; this layer adds Megatron's
tensor and sequence parallelism around them. The pass input (:meth:`LatentFeedback.pass_input`, what every
forward here uses: the whole model, the pipeline's first stage, the KV-cache decoder):
- pass 1: x_t = e_t at every position — exactly a standard GPT on the same weights;
- pass j >= 2: x_t = fuse(h^(j-1)_{t-1}, e_t) where t has a previous position in its document, and
  x_t = e_t at position 0 and at every document start (there is no state there).
The true recurrence follows the same rule (x_0 = e_0, x_t = fuse(h_{t-1}, e_t)), so after k passes the
first k positions of every document are exact. ``first_input="state"`` is the ablation that feeds
fuse(h_init, e_t) wherever there is no previous state instead (pass 1 then is not a standard GPT).

Which state is fed back: the *final-layernorm output* of the top layer (exactly what the LM head
reads). It is normalised, so its scale does not grow with depth or passes, which keeps the
pass-to-pass map well conditioned.

Tensor parallelism: W_U and W_G are Megatron ColumnParallelLinear layers (each rank holds D/TP output
rows of both), the product is formed on the local slice and gathered back to [S, B, D]. With sequence
parallelism the local slice is redistributed to the sequence-parallel layout by an all-to-all instead.

Stabilisers (switches in FeedbackConfig; our documented reading of the paper, see docs/feedback.md):
- prefix mixin a: the fed-back state is (1-a) h + a h_init, a pull toward a learned constant state.
  With ``mixin: affine`` W_U can grow to undo the (1-a); with ``mixin: bounded`` the fusion applies
  W_U / max(1, sigma_max(W_U)), so ||d x_t / d h_{t-1}|| <= (1-a) * max gate < 1 - a: the part of the
  pass-to-pass map the feedback adds is a contraction by (1-a) whatever the weights learn;
- depth scaling: a normal-initialised W_U starts at std / sqrt(2 * num_layers), like Megatron's
  residual-output init;
- weight tying: input embedding and LM head share weights (ModelConfig.tie_embeddings), so fed-back
  states and token embeddings live in one space;
- jitter: N(0, jitter_std^2) noise on the fed-back state, training only, drawn from a generator
  seeded by the caller so it is reproducible on resume and identical on all TP ranks.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule

from fbt_megatron.config import FeedbackConfig
from fbt_megatron.model import feedback_rule as rule


class LatentFeedback(MegatronModule):
    def __init__(self, config: TransformerConfig, feedback: FeedbackConfig):
        super().__init__(config)
        self.feedback = feedback
        self.mode = feedback.fusion
        self.sequence_parallel = config.sequence_parallel
        # B while a micro-batch's B rows run laid end to end as one row (packed attention under sequence
        # parallelism): the jitter is then drawn as for the B rows, so the layouts train alike.
        self.rows_as_one: int | None = None
        hidden = config.hidden_size
        # The fusion sees full-sequence inputs (the shift crosses sequence-parallel chunks), so its
        # linears are built without sequence parallelism; the output is redistributed explicitly.
        linear_config = replace(config, sequence_parallel=False)
        std = config.init_method_std
        if feedback.value_init == "identity":
            value_init = scaled_identity_init(feedback.value_init_scale or 2.0 * std)
        else:
            value_std = std / math.sqrt(2.0 * config.num_layers) if feedback.depth_scaling else std
            value_init = normal_init(value_std)

        def linear(init_method):
            return tensor_parallel.ColumnParallelLinear(
                hidden, hidden, config=linear_config, bias=feedback.bias, gather_output=False,
                init_method=init_method,
            )

        self.value = linear(value_init)  # W_U: acts on the fed-back state
        gate_std = 1.0 / (math.sqrt(hidden) * std) if feedback.gate_init == "unit_spread" else std
        self.gate = linear(normal_init(gate_std))  # W_G: acts on the token embedding
        for p in (*self.value.parameters(), *self.gate.parameters()):
            p.latent_feedback_fusion = True  # the optimiser decays them only once feedback runs (engine/param_groups.py)
        # h_init: the prefix mixin's anchor (and, under first_input="state", the state wherever none
        # exists). Unit scale, like a final-layernorm output.
        self.initial_state = torch.nn.Parameter(torch.empty(hidden, dtype=config.params_dtype))
        with torch.no_grad():
            self.initial_state.normal_(0.0, 1.0)
        if feedback.mixin == "bounded":
            # the power iteration's vector, the same on every TP rank (a fixed generator), warm from step to step
            start = torch.randn(hidden, generator=torch.Generator().manual_seed(0))
            self.register_buffer("_power_vector", start / start.norm(), persistent=False)
            self._power_warm = False  # the first training forward (a new model, a resume) converges it
            self._exact_sigma: tuple | None = None  # (weight version, sigma) for eval-mode forwards

    def train(self, mode: bool = True):
        # the eval-mode sigma is recomputed after any training: DeepSpeed's ZeRO-1/2 and bf16 optimisers
        # write updates through flat buffers, which bump neither the weight's version nor its address
        self._exact_sigma = None
        return super().train(mode)

    # ----------------------------------------------------------------- the bounded mixin
    def value_weight(self) -> torch.Tensor | None:
        """W_U as the fusion applies it: None (the parameter as it is) under ``mixin: affine``; under
        ``bounded`` W_U / max(1, sigma_max(W_U)) (this rank's rows). sigma is exact in eval mode
        (validation, decoding, analysis; a constant there), so the bound is exact there; in training it
        is a power-iteration estimate (never above sigma), differentiable, warm from forward to forward
        (one iteration each, as torch's spectral_norm; 30 on the first forward of a process)."""
        if self.feedback.mixin != "bounded":
            return None
        weight = self.value.weight
        sigma = self._sigma_exact(weight) if not self.training else self._sigma_estimate(weight)
        return rule.bounded(weight, sigma)

    def _sigma_exact(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version)
        if self._exact_sigma is None or self._exact_sigma[0] != key:
            w = weight.detach().float()
            gram = tensor_parallel.reduce_from_tensor_model_parallel_region(w.t() @ w)  # sum over TP row blocks
            self._exact_sigma = (key, torch.linalg.eigvalsh(gram)[-1].clamp_min(0.0).sqrt())
        return self._exact_sigma[1]

    def _sigma_estimate(self, weight: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            w, v = weight.detach().float(), self._power_vector.to(weight.device)
            for _ in range(1 if self._power_warm else 30):
                v = tensor_parallel.reduce_from_tensor_model_parallel_region(w.t() @ (w @ v))
                v = v / v.norm().clamp_min(1e-12)
            self._power_vector, self._power_warm = v, True
        u = weight.float() @ self._power_vector.to(weight.device)  # this rank's rows of W v
        # sum over TP ranks both ways: sigma scales every rank's rows, so its gradient is the sum of all ranks'
        squared = tensor_parallel.reduce_from_tensor_model_parallel_region(u.square().sum())
        return tensor_parallel.copy_to_tensor_model_parallel_region(squared).sqrt()

    # ----------------------------------------------------------------- the recurrence's pieces
    def fed_back(self, top_state: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """What of h_{t-1} reaches position t: prefix mixin (:func:`rule.mix`), then jitter (training only)."""
        state = rule.mix(top_state, self.initial_state, self.feedback.prefix_mixin)
        if self.training and self.feedback.jitter_std > 0:
            shape = state.shape
            if self.rows_as_one and shape[1] == 1:  # drawn in the rows' [S, B, D] order, laid end to end
                rows = self.rows_as_one
                noise = torch.randn((shape[0] // rows, rows, shape[2]), generator=generator, device=state.device,
                                    dtype=state.dtype).transpose(0, 1).reshape(shape)
            else:
                noise = torch.randn(shape, generator=generator, device=state.device, dtype=state.dtype)
            state = state + self.feedback.jitter_std * noise
        return state

    def initial_states(self) -> torch.Tensor:
        """h_init as a broadcastable [1, 1, D] (the value projection of a constant is then computed
        once, not once per token)."""
        return self.initial_state.view(1, 1, -1)

    def shift_states(self, top_state: torch.Tensor, reset: torch.Tensor, generator=None) -> torch.Tensor:
        """[S, B, D] top states of the previous pass -> the state each position receives.

        Position t gets the fed-back h_{t-1}; positions where ``reset`` [S, B] is True (position 0
        and every document start) have no previous state: they get h_init here as a placeholder that
        :meth:`stack_input` replaces with the rule's stateless input.
        """
        return rule.shifted_states(self.fed_back(top_state, generator), reset, self.initial_state, dim=0)

    # ----------------------------------------------------------------- the pass input (the rule)
    @property
    def plain_first_pass(self) -> bool:
        """Pass 1 is the ordinary transformer (token embeddings in, no fusion computed)."""
        return self.feedback.first_input == "embedding"

    def needs_token_gate(self, num_passes: int) -> bool:
        """Whether a forward of ``num_passes`` passes reads sigmoid(W_G e) at all."""
        return num_passes > 1 or not self.plain_first_pass

    def pass_input(self, previous_top: torch.Tensor | None, embedded: torch.Tensor, token_gate, reset,
                   generator: torch.Generator | None = None) -> torch.Tensor:
        """The stack input of one pass over a sequence.

        ``previous_top``: None for pass 1, else the previous pass's top states [S, B, D] (full
        sequence; shifted one position right here). ``embedded``: token (+ position) embeddings in the
        stack's layout ([S, B, D], [S/TP, B, D] under sequence parallelism). ``token_gate``:
        :meth:`token_gate` of the full-sequence embeddings (None is fine when
        :meth:`needs_token_gate` is False). ``reset`` [S, B]: positions with no previous state in
        their document (position 0 and every document start)."""
        if previous_top is None:  # pass 1: no position has a previous state
            return self.stateless_input(embedded, token_gate)
        state = self.shift_states(previous_top, reset, generator)
        return self.stack_input(state, embedded, token_gate, reset)

    def stack_input(self, state: torch.Tensor, embedded: torch.Tensor, token_gate: torch.Tensor,
                    reset: torch.Tensor) -> torch.Tensor:
        """fuse(state, e) where a previous state exists; where ``reset`` [S, B] is True, the
        rule's stateless input (:func:`rule.stack_input`, in this rank's layout). ``state`` is already the
        fed-back state of each position (the KV-cache decoder passes h_{t-1} of each sequence's one new
        position)."""
        return rule.stack_input(state, embedded, token_gate, self._stack_layout(reset), self.initial_state,
                                self.feedback.first_input, self.fuse)

    def stateless_input(self, embedded: torch.Tensor, token_gate: torch.Tensor | None) -> torch.Tensor:
        """The input where no position has a state (pass 1, standard decoding): e_t, or under the
        ``state`` rule fuse(h_init, e_t)."""
        return rule.stateless_input(embedded, token_gate, self.initial_state, self.feedback.first_input, self.fuse)

    def _stack_layout(self, per_position: torch.Tensor) -> torch.Tensor:
        """[S, B] -> this rank's [S/TP, B] slice under sequence parallelism (as the stack input)."""
        if not self.sequence_parallel:
            return per_position
        tp = parallel_state.get_tensor_model_parallel_world_size()
        return per_position.chunk(tp, dim=0)[parallel_state.get_tensor_model_parallel_rank()]

    # ----------------------------------------------------------------- the fusion
    def forward(self, state: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """Fuse states [S, B, D] (or a broadcastable [1, 1, D]) with token embeddings [S, B, D].

        Returns [S, B, D], or [S/TP, B, D] under sequence parallelism.
        """
        return self.fuse(state, self.token_gate(embedded))

    def token_gate(self, embedded: torch.Tensor) -> torch.Tensor:
        """The token path [S, B, D/TP] (:func:`rule.token_gate`): sigmoid(W_G e) for glu, W_G e for
        additive. It does not depend on the fed-back state, so a k-pass forward computes it once."""
        gate, _ = self.gate(embedded)
        return rule.token_gate(gate, self.mode)

    def fuse(self, state: torch.Tensor, token_gate: torch.Tensor) -> torch.Tensor:
        """Fuse states with a precomputed :meth:`token_gate`; same output as :meth:`forward`."""
        value, _ = self.value(state, weight=self.value_weight())
        local = rule.fuse(value, token_gate, self.mode)  # this rank's D/TP columns
        if self.sequence_parallel:  # [S*B, D/TP] -> [S*B/TP, D]: tokens are sequence-major
            seq, batch, _ = local.shape
            tokens = tensor_parallel.all_to_all_hp2sp(local.reshape(seq * batch, -1))
            return tokens.view(-1, batch, tokens.shape[-1])
        return tensor_parallel.gather_from_tensor_model_parallel_region(local)


def normal_init(std: float):
    return lambda w: torch.nn.init.normal_(w, 0.0, std)


def scaled_identity_init(scale: float):
    """W = scale * I for a [D, D] weight, or this rank's [D/TP, D] row block of it (Megatron's GPU
    init calls the init method on the local partition; its CPU init on the whole master weight)."""

    def init(weight: torch.Tensor) -> torch.Tensor:
        rows, cols = weight.shape
        offset = 0
        if rows != cols:  # a column-parallel partition: rows [rank * rows, (rank + 1) * rows)
            offset = parallel_state.get_tensor_model_parallel_rank() * rows
        with torch.no_grad():
            weight.zero_()
            index = torch.arange(rows, device=weight.device)
            weight[index, index + offset] = scale
        return weight

    return init
