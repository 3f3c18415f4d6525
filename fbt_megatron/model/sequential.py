"""The true recurrence, token by token: the reference multi-pass training must converge to.

For t = 0..S-1: state_t = h_init at a document start (and t = 0), else the fed-back h_{t-1};
x_t = fuse(state_t, e_t); h_t = top state of the stack at position t given x_0..x_t, attending
and positioned as the model's ``attention_mask`` says (only its own document's x_j with
``document_causal``, computed here by the same mask and positions as training). This plain
implementation re-runs the causal stack on the growing prefix (O(S^2), no KV cache): it exists to be
obviously right, for tests and as the simplest decoder.
"""

from __future__ import annotations

import torch

from fbt_megatron.model.fbt_gpt import FBTGPTModel, FBTOutput, reset_positions


@torch.no_grad()
def sequential_forward(model: FBTGPTModel, input_ids, position_ids=None, doc_start=None) -> FBTOutput:
    """Logits [B, S, V/TP] and top states [S, B, D] of the exact recurrence (eval-mode semantics)."""
    if model.feedback is None:
        raise ValueError("feedback.fusion='off' has no recurrence to run")
    if model.config.sequence_parallel:
        raise ValueError("sequential_forward runs without sequence parallelism")
    batch, seq_len = input_ids.shape
    reset = reset_positions(doc_start, batch, seq_len, input_ids.device)
    mask, positions = model.attention_inputs(reset, position_ids)
    embedded = model.gpt.embedding(input_ids=input_ids, position_ids=positions)  # [S, B, D]

    h0 = model.feedback.initial_state
    inputs, tops = [], []
    for t in range(seq_len):
        if t == 0:
            state = h0.expand(batch, -1)
        else:
            fed = model.feedback.fed_back(tops[-1])
            state = torch.where(reset[t].unsqueeze(-1), h0.expand(batch, -1), fed)
        inputs.append(model.feedback(state.unsqueeze(0), embedded[t : t + 1]))
        prefix = torch.cat(inputs, dim=0)
        top = model.run_stack(prefix, mask[..., : t + 1, : t + 1], model.rotary(positions[:, : t + 1]))
        tops.append(top[-1])
    hidden = torch.stack(tops, dim=0)
    return FBTOutput(logits=model.head(hidden), hidden=hidden)
