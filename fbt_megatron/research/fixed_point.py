"""The pass-to-pass map of a trained model, iterated far past training depth.

:func:`iterate_passes` runs k = 1..K passes of teacher forcing on fixed inputs (one stack forward
per pass, eval mode, no jitter) and records the relative residual of the top states between
successive passes. :func:`one_step_jacobian_norms` estimates, at the converged states, the spectral
norm of J_t = d h_t / d h_{t-1}: the map from one position's fed-back state to the next position's
top state, the factor by which a pass carries an error one position further.

Separating contraction from exactness: after k passes positions < k are exact, so for k >= S (the
sequence length) the residual is exactly 0 whatever the weights. Below S a residual falls only if
the error that is still travelling is damped: the contraction ratio r_{k+1}/r_k then sits below 1
and matches the one-step spectral norm; without contraction the residual stays flat (or grows) until
the exactness front reaches the end of the sequence and then drops to 0 at once.
"""

from __future__ import annotations

import torch

from fbt_megatron.model.fbt_gpt import reset_positions
from fbt_megatron.research.stability import hutchinson_frobenius, power_spectral_norm


def stack_inputs(model, input_ids: torch.Tensor, doc_start=None):
    """What every pass shares: token embeddings [S, B, D], attention mask, RoPE table, resets [S, B]
    (the model's own document-aware mask and positions)."""
    batch, seq = input_ids.shape
    reset = reset_positions(doc_start, batch, seq, input_ids.device)
    mask, positions = model.attention_inputs(reset)
    emb = model.gpt.embedding(input_ids=input_ids, position_ids=positions)
    return emb, mask, model.rotary(positions), reset


@torch.no_grad()
def iterate_passes(model, input_ids: torch.Tensor, max_passes: int, doc_start=None) -> dict:
    """Residuals ||h^{k+1} - h^k|| / ||h^k|| for k = 1..max_passes-1, and the final top states."""
    model.eval()
    fb = model.feedback
    emb, mask, rotary, reset = stack_inputs(model, input_ids, doc_start)
    gate = fb.token_gate(emb)
    top = model.run_stack(fb.pass_input(None, emb, gate, reset), mask, rotary)
    residuals = []
    for _ in range(max_passes - 1):
        new = model.run_stack(fb.pass_input(top, emb, gate, reset), mask, rotary)
        residuals.append(float((new - top).norm() / top.norm().clamp_min(1e-30)))
        top = new
    return {"residuals": residuals, "top": top, "emb": emb, "reset": reset}


def one_step_jacobian_norms(model, input_ids: torch.Tensor, top: torch.Tensor, positions: list[int],
                            row: int = 0, iters: int = 30) -> list[dict]:
    """At the converged states ``top`` [S, B, D]: for each position t, sigma_max and ||.||_F of
    d h_t / d h_{t-1} (other positions' inputs held fixed), in eval mode."""
    model.eval()
    fb = model.feedback
    ids = input_ids[row : row + 1]
    seq = ids.shape[1]
    with torch.no_grad():
        emb, mask, rotary, reset = stack_inputs(model, ids)
        gate = fb.token_gate(emb)
        base_state = fb.shift_states(top[:, row : row + 1], reset)  # the fixed point's fed-back states
    out = []
    for t in positions:
        if not 1 <= t < seq:
            raise ValueError(f"position {t} must be in [1, {seq})")
        prefix_state = base_state[: t + 1]

        def step(h_prev, t=t, prefix_state=prefix_state):
            # h_{t-1} -> what position t receives (prefix mixin, no jitter in eval) -> h_t
            state = torch.cat([prefix_state[:t], fb.fed_back(h_prev).view(1, 1, -1)], dim=0)
            x = fb.stack_input(state, emb[: t + 1], gate[: t + 1], reset[: t + 1])
            return model.run_stack(x, mask[..., : t + 1, : t + 1], rotary[: t + 1] if rotary is not None else None)[-1, 0]

        h_prev = top[t - 1, row].detach()
        out.append({"position": t, "spectral_norm": power_spectral_norm(step, h_prev, iters=iters),
                    "frobenius_norm": hutchinson_frobenius(step, h_prev, samples=8)})
    return out
