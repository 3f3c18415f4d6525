"""The latent-feedback rule as plain torch functions: what each position of a pass feeds the bottom of the stack.

The one definition that the Megatron model (``model/feedback.py``, which adds tensor and sequence parallelism
around these functions), the Hugging Face remote code (``modeling_fbt.py``) and the vLLM plugin
(``serving/vllm_model.py``) all call, so that the three cannot drift apart. It imports torch only: every
``fbt convert to-hf`` export ships this file beside ``modeling_fbt.py``, which imports it as a sibling
(``from .feedback_rule import ...``); transformers copies relative imports of remote code with it.

The rule, for pass k >= 2 (pass 1 is the stateless input everywhere):

    s_t = (1 - a) h_{t-1} + a h_init                       mix: prefix mixin a, h the final-norm top state
    x_t = (W_U s_t) * token_gate_t                         fuse (``glu``); ``additive``: W_U s_t + token_gate_t
    x_t = e_t  (or fuse(h_init, e_t) under first_input="state")   where ``reset`` (no previous state)

One name per quantity, in every caller:

- ``token_gate``: the token's term of the fusion, sigmoid(W_G e_t) under ``glu`` and W_G e_t under ``additive``
  (:func:`token_gate`); it does not depend on the state, so a forward computes it once for all its passes;
- ``value``: W_U s, the state through the value projection, with W_U as the fusion applies it (under the bounded
  mixin W_U / max(1, sigma_max(W_U)): :func:`bounded`);
- ``reset``: the positions with no previous state, where the stack reads the stateless input (the first
  position and every document start: :func:`reset_positions`, :func:`attended_starts`).

Layouts: ``dim`` is the sequence axis where it matters (Megatron's [S, B, D]: 0; transformers' [B, S, D]: 1);
h_init ([D]) broadcasts against any layout, vLLM's flattened [N, D] included (:func:`broadcast_state`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FIRST_INPUTS = ("embedding", "state")

Fuse = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (state, token_gate) -> stack input


def token_gate(gate: torch.Tensor, fusion: str) -> torch.Tensor:
    """``gate`` = W_G e (+ b_G) -> the token's term of the fusion: sigmoid(gate) for glu, gate for additive."""
    return torch.sigmoid(gate) if fusion == "glu" else gate


def bounded(weight: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """W_U as the bounded mixin applies it: W_U / max(1, sigma), sigma its largest singular value (exact or
    estimated by the caller), so the feedback's part of the pass-to-pass map is a contraction by (1 - a)."""
    return weight / sigma.clamp_min(1.0).to(weight.dtype)


def spectral_norm(weight: torch.Tensor) -> torch.Tensor:
    """sigma_max of a whole matrix, in float32 or wider."""
    return torch.linalg.matrix_norm(weight.float(), ord=2)


def mix(top: torch.Tensor, initial_state: torch.Tensor, prefix_mixin: float) -> torch.Tensor:
    """The fed-back state (1 - a) h + a h_init (the prefix mixin: a pull toward a learned constant state)."""
    a = prefix_mixin
    return (1.0 - a) * top + a * initial_state if a else top


def shift(states: torch.Tensor, first: torch.Tensor, dim: int) -> torch.Tensor:
    """One position later along ``dim``: out[t] = states[t-1]; out[0] = ``first`` (broadcast to one position)."""
    n = states.shape[dim]
    return torch.cat([first.expand_as(states.narrow(dim, 0, 1)), states.narrow(dim, 0, n - 1)], dim=dim)


def shifted_states(fed: torch.Tensor, reset: torch.Tensor, initial_state: torch.Tensor, dim: int) -> torch.Tensor:
    """The state each position receives from fed-back states ``fed``: the previous position's, and h_init where
    ``reset`` (a placeholder: :func:`stack_input` reads the stateless input there)."""
    return torch.where(reset.unsqueeze(-1), initial_state.to(fed.dtype), shift(fed, initial_state, dim))


def reset_positions(doc_start: torch.Tensor | None, shape: tuple[int, ...], dim: int, device) -> torch.Tensor:
    """bool ``shape``: True at the first position along ``dim`` and wherever ``doc_start`` (same shape, or None)
    marks a document start: the positions with no previous state in their document."""
    if doc_start is None:
        reset = torch.zeros(shape, dtype=torch.bool, device=device)
    else:
        reset = doc_start.to(device=device, dtype=torch.bool).clone()
    reset.select(dim, 0).fill_(True)
    return reset


def attended_starts(mask: torch.Tensor, dim: int) -> torch.Tensor:
    """The document starts of a padded batch: where an attended run begins along ``dim`` (``mask`` bool)."""
    return mask & ~shift(mask, torch.zeros((), dtype=mask.dtype, device=mask.device), dim)


def broadcast_state(initial_state: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """h_init [D] as [1, ..., 1, D] of ``like``'s rank: its value projection is computed once, not per token."""
    return initial_state.view(*(1,) * (like.dim() - 1), -1)


def fuse(value: torch.Tensor, token_gate: torch.Tensor, fusion: str) -> torch.Tensor:
    """The fusion from ``value`` = W_U s and the :func:`token_gate`: value * token_gate (glu) or value + token_gate
    (additive), broadcast to ``token_gate``'s shape (a constant state's value is one row)."""
    out = value * token_gate if fusion == "glu" else value + token_gate
    return out.expand(token_gate.shape)


def stateless_input(embedded: torch.Tensor, token_gate: torch.Tensor | None, initial_state: torch.Tensor,
                    first_input: str, fuse: Fuse) -> torch.Tensor:
    """The stack input where no position has a state: e_t (``first_input="embedding"``: pass 1 is the ordinary
    transformer), or fuse(h_init, e_t) under the ``state`` ablation. ``fuse`` is the caller's whole fusion
    (state, token_gate) -> stack input; ``token_gate`` may be None under the embedding rule."""
    if first_input == "embedding":
        return embedded
    return fuse(broadcast_state(initial_state, token_gate), token_gate)


def stack_input(state: torch.Tensor, embedded: torch.Tensor, token_gate: torch.Tensor, reset: torch.Tensor,
                initial_state: torch.Tensor, first_input: str, fuse: Fuse) -> torch.Tensor:
    """fuse(state, e) where a previous state exists; the :func:`stateless_input` where ``reset`` ([..., S] or
    [N], the stack input's shape without D). ``state``: each position's fed-back state."""
    fused = fuse(state, token_gate)
    stateless = stateless_input(embedded, token_gate, initial_state, first_input, fuse)
    return torch.where(reset.unsqueeze(-1), stateless, fused)
