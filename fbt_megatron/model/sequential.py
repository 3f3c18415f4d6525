"""The true recurrence, token by token, written from the paper's formulas: the reference multi-pass
training must converge to.

For each row and t = 0..S-1, with d(t) the start of t's document (position 0 or a ``doc_start``):

    x_t = e_t                                                   at a document start (no state exists)
    x_t = (W_U s_t + b_U) * sigmoid(W_G e_t + b_G)              elsewhere (glu; additive: sum)
    s_t = (1 - a) h_{t-1} + a h_init                            (prefix mixin a)
    W_U <- W_U / max(1, sigma_max(W_U))                         (mixin: bounded)
    h_t = Stack(x_{d(t)}, ..., x_t)[-1]                         (document_causal: the document only,
                                                                 positions counted from d(t);
                                                                 causal: x_0, ..., x_t, positions t)
    logits_t = h_t W_out^T                                      (padded vocabulary columns -inf)

Under the ``state`` ablation x_t = fuse(h_init, e_t) at a document start instead. Only the stack
(Megatron's transformer layers + final norm, which the recurrence does not change) and the token
embedding lookup are the model's own modules; the fusion, the mixin, the document boundaries, the
positions, the attention span and the head are computed here from the weights, so the model's
multi-pass forward and the decoders are checked against the formulas, not against themselves.
O(S^2) stack runs, one row at a time, no KV cache: it exists to be obviously right (tests, demo).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fbt_megatron.model.fbt_gpt import FBTGPTModel, FBTOutput


def _linear(x, layer):
    return F.linear(x, layer.weight, layer.bias)


def _fusion(model: FBTGPTModel):
    """x = fuse(s, e) from the weights of W_U, W_G (TP=1: the whole matrices)."""
    fb, cfg = model.feedback, model.feedback_config

    w_u = fb.value.weight
    if cfg.mixin == "bounded":  # W_U / max(1, its largest singular value)
        w_u = w_u / torch.linalg.matrix_norm(w_u.float(), ord=2).clamp_min(1.0).to(w_u.dtype)

    def fuse(state, embedded):
        value, gate = F.linear(state, w_u, fb.value.bias), _linear(embedded, fb.gate)
        return value * torch.sigmoid(gate) if cfg.fusion == "glu" else value + gate

    return fuse


def _head(model: FBTGPTModel, hidden: torch.Tensor) -> torch.Tensor:
    """[S, B, D] -> [B, S, V_pad] logits, padded columns -inf."""
    gpt = model.gpt
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights \
        else gpt.output_layer.weight
    logits = F.linear(hidden, weight).transpose(0, 1)
    logits[..., model.model_config.vocab_size:] = float("-inf")
    return logits.contiguous()


@torch.no_grad()
def sequential_forward(model: FBTGPTModel, input_ids, position_ids=None, doc_start=None) -> FBTOutput:
    """Logits [B, S, V_pad] and top states [S, B, D] of the exact recurrence (eval-mode semantics)."""
    if model.feedback is None:
        raise ValueError("feedback.fusion='off' has no recurrence to run")
    if model.config.tensor_model_parallel_size != 1 or model.pipelined:
        raise ValueError("sequential_forward is the single-process reference (TP=1, PP=1)")
    cfg, fuse = model.feedback_config, _fusion(model)
    a, h_init = cfg.prefix_mixin, model.feedback.initial_state
    document_causal = model.model_config.attention_mask == "document_causal"
    batch, seq_len = input_ids.shape
    starts = torch.zeros(batch, seq_len, dtype=torch.bool) if doc_start is None else doc_start.bool().cpu().clone()
    starts[:, 0] = True
    rope = None
    if model.model_config.position_embedding_type == "rope":
        rope = model.gpt.rotary_pos_emb(model.model_config.max_sequence_length)  # [P, 1, 1, d]

    tops = torch.zeros(seq_len, batch, model.config.hidden_size, dtype=model.config.params_dtype,
                       device=input_ids.device)
    for b in range(batch):
        doc_first = 0
        positions = []
        for t in range(seq_len):
            if starts[b, t]:
                doc_first = t
            positions.append(t - doc_first if document_causal else t)
        positions = torch.tensor(positions, device=input_ids.device)
        if position_ids is not None:
            positions = position_ids[b].to(input_ids.device)
        embedded = model.gpt.embedding(input_ids=input_ids[b:b + 1], position_ids=positions.view(1, -1))  # [S, 1, D]
        inputs = []
        doc_first = 0
        for t in range(seq_len):
            e_t = embedded[t:t + 1]
            if starts[b, t]:
                doc_first = t
                x_t = e_t if cfg.first_input == "embedding" else fuse(h_init.view(1, 1, -1), e_t)
            else:
                state = (1.0 - a) * tops[t - 1, b] + a * h_init
                x_t = fuse(state.view(1, 1, -1), e_t)
            inputs.append(x_t)
            first = doc_first if document_causal else 0
            prefix = torch.cat(inputs[first:], dim=0)  # [L, 1, D]
            span = prefix.shape[0]
            causal = torch.ones(span, span, dtype=torch.bool, device=prefix.device).triu(1)[None, None]
            rotary = None if rope is None else rope[positions[first:t + 1]]
            top = model.gpt.decoder(hidden_states=prefix, attention_mask=causal, rotary_pos_emb=rotary)
            tops[t, b] = top[-1, 0]
    return FBTOutput(logits=_head(model, tops), hidden=tops)
