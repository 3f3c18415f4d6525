"""KV-cache decoding with latent feedback.

Each new token's stack input is the fusion of the previous position's top state with its
embedding, by the model's one pass-input rule (``LatentFeedback.stack_input``), in
:meth:`DecodeSession._run_slot`::

    state = fed_back(prev_top)                  # h_{t-1} (prefix mixin applied)
    x_t   = stack_input(state, e_t, gate, ...)  # (W_U h_{t-1}) * sigmoid(W_G e_t); e_t at a sequence start

The KV cache is Megatron-Core's own ``StaticInferenceContext`` passed to the decoder
(``TransformerBlock``): attention writes each step's keys/values at ``sequence_len_offset`` and
attends over the cached prefix. It runs on CPU with the runtime shims (its buffers are allocated on
``torch.cuda.current_device()``, which the CPU shim answers with ``"cpu"``).

Prompt prefill (``prefill_passes``):
- ``K`` (an int): K Jacobi passes over the whole prompt in parallel, as training's multi-pass
  teacher forcing does (``LatentFeedback.pass_input``). K=1 is an ordinary forward of the prompt's
  embeddings; K=2 is the paper's FUSED prefill; only the last pass fills the KV cache. After K passes
  the first K prompt positions are exact.
- ``"exact"``: the recurrence itself, one prompt token at a time through the cache (equal to K =
  prompt length, at the cost of one pass).
``mode="standard"`` decodes without feedback: the plain transformer (token embeddings in, no fusion
computed; under the ``state`` ablation every position fuses h_init), for comparison.

Batches of prompts are laid out in *slots* (the cache's sequence axis): left padding right-aligns
prompts, right padding left-aligns them; generated tokens take the slots after the longest prompt.
Every sequence keeps its own positions (0 at its first token: a prompt is one document), its own
rotary table rows and a key mask hiding padding slots, so each prompt's tokens and logits are those
it gets when run alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fbt_megatron.generate.model import full_vocab_logits
from fbt_megatron.generate.sampling import SamplingParams, sample_next
from fbt_megatron.model.fbt_gpt import FBTGPTModel

MODES = ("feedback", "standard")
PADDING = ("left", "right")


def parse_prefill_passes(value) -> int | str:
    if value == "exact":
        return "exact"
    try:
        k = int(value)
    except (TypeError, ValueError):
        k = 0
    if k < 1 or (isinstance(value, float) and value != k):
        raise ValueError(f"prefill_passes={value!r} is invalid; allowed: an integer >= 1 or 'exact'")
    return k


class DecodeSession:
    """One batch's decoding state: the KV cache, the slot layout and each sequence's last top state."""

    def __init__(self, model: FBTGPTModel, prompts: Sequence[Sequence[int]], appended: int | Sequence[int], *,
                 mode: str, prefill_passes, padding: str):
        """``appended``: how many tokens will be fed after each prompt (one int for all, or one per
        prompt); that many slots are allocated after the longest prompt."""
        from megatron.core.inference.contexts import StaticInferenceContext

        if not prompts:
            raise ValueError("no prompts given")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("an empty prompt cannot be decoded (give at least one token, e.g. BOS/EOS)")
        if padding not in PADDING:
            raise ValueError(f"padding={padding!r} is not one of {PADDING}")
        self.model, self.mode, self.passes = model, mode, prefill_passes
        self.device = next(model.parameters()).device
        lengths = [len(p) for p in prompts]
        extra = [appended] * len(prompts) if isinstance(appended, int) else list(appended)
        batch, width = len(prompts), max(lengths)
        self.batch, self.width, self.total = batch, width, width + max(extra)
        limit = model.model_config.max_sequence_length
        for n, e in zip(lengths, extra):
            if n + e > limit:
                raise ValueError(f"a prompt of {n} tokens followed by {e} fed tokens needs {n + e} positions; "
                                 f"the model's max_sequence_length={limit}")

        # Slot layout. positions: [total, B]; valid: [B, total] (False = padding, never attended).
        tokens = torch.zeros(batch, width, dtype=torch.long)
        valid = torch.zeros(batch, self.total, dtype=torch.bool)
        positions = torch.zeros(self.total, batch, dtype=torch.long)
        first = []
        after = torch.arange(self.total - width)
        for b, ids in enumerate(prompts):
            off = width - len(ids) if padding == "left" else 0
            tokens[b, off:off + len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
            valid[b, off:off + len(ids)] = True
            valid[b, width:] = True
            positions[off:off + len(ids), b] = torch.arange(len(ids))
            # slots past this sequence's own need (a shorter continuation in the batch) are unused:
            # their positions are clamped into the model's range
            positions[width:, b] = (len(ids) + after).clamp_max(limit - 1)
            first.append(off)
        self.tokens, self.valid = tokens.to(self.device), valid.to(self.device)
        self.positions = positions.to(self.device)
        self.first = torch.as_tensor(first, device=self.device)
        self.last = self.first + torch.as_tensor(lengths, device=self.device) - 1
        self.rotary = self._rotary_table()
        self.context = StaticInferenceContext(batch, self.total)
        self.next_slot = 0
        self.prev_top = None  # [1, B, D]: each sequence's top state at its last real slot
        self.has_prev = torch.zeros(batch, dtype=torch.bool, device=self.device)

    # ------------------------------------------------------------------ pieces
    def _rotary_table(self):
        """[total, B, 1, d]: each slot's rotary angles at *its sequence's* position (Megatron's
        attention slices the slot axis; the batch axis broadcasts against [S, B, heads, d])."""
        gpt = self.model.gpt
        if self.model.model_config.position_embedding_type != "rope":
            return None
        table = gpt.rotary_pos_emb(int(self.positions.max()) + 1)  # [P, 1, 1, d]
        return table[:, 0][self.positions]

    def _embed(self, token_ids: torch.Tensor, slots: slice) -> torch.Tensor:
        """[B, S] tokens at ``slots`` -> [S, B, D] embeddings (per-sequence learned positions)."""
        return self.model.gpt.embedding(input_ids=token_ids, position_ids=self.positions[slots].t())

    def _feeds_back(self) -> bool:
        return self.mode == "feedback" and self.model.feedback is not None

    def _token_gate(self, embedded: torch.Tensor, passes: int):
        fb = self.model.feedback
        return fb.token_gate(embedded) if fb is not None and fb.needs_token_gate(passes) else None

    def _stack(self, x, mask, use_cache: bool):
        """The transformer layers (+ final norm). With the cache, attention slices the rotary table
        at the context's offset itself; without it (earlier prefill passes) the table is cut here."""
        rotary = self.rotary if use_cache or self.rotary is None else self.rotary[: x.shape[0]]
        return self.model.gpt.decoder(hidden_states=x, attention_mask=mask, rotary_pos_emb=rotary,
                                      inference_context=self.context if use_cache else None)

    def _prefill_mask(self) -> torch.Tensor:
        w = self.width
        causal = torch.triu(torch.ones(w, w, dtype=torch.bool, device=self.device), diagonal=1)
        return causal[None, None] | ~self.valid[:, None, None, :w]  # [B, 1, W, W], True = masked

    def _run_slot(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Feed one token per sequence at the next slot through the cached stack; returns [1, B, D]."""
        slot = self.next_slot
        if slot >= self.total:
            raise RuntimeError(f"the session's {self.total} slots are used up")
        embedded = self._embed(token_ids.view(-1, 1).to(self.device), slice(slot, slot + 1))
        fb = self.model.feedback
        if fb is None:  # fusion=off: a plain GPT
            x = embedded
        elif not self._feeds_back() or self.prev_top is None:
            x = fb.stateless_input(embedded, self._token_gate(embedded, 1))
        else:  # the latent feedback, fused with the new token's embedding where a state exists
            x = fb.stack_input(fb.fed_back(self.prev_top), embedded, fb.token_gate(embedded), ~self.has_prev.view(1, -1))
        self.context.sequence_len_offset = slot
        top = self._stack(x, ~self.valid[:, None, None, : slot + 1], use_cache=True)
        real = self.valid[:, slot].view(1, -1, 1)
        self.prev_top = top if self.prev_top is None else torch.where(real, top, self.prev_top)
        self.has_prev |= self.valid[:, slot]
        self.next_slot = slot + 1
        return top

    # ------------------------------------------------------------------ API
    @torch.no_grad()
    def prefill(self, return_all: bool = False):
        """Run the prompts; returns next-token logits [B, V] (and, with ``return_all``, the logits of
        every prompt slot [B, W, V])."""
        self.context.reset()
        if self.passes == "exact" and self._feeds_back():
            tops = [self._run_slot(self.tokens[:, s]) for s in range(self.width)]
            top = torch.cat(tops, dim=0)
        else:
            top = self._parallel_prefill()
        self.context.sequence_len_offset = self.width
        self.next_slot = self.width
        self.context.enable_decode_mode()
        last = full_vocab_logits(self.model, self.prev_top)[:, 0]
        if return_all:
            return last, full_vocab_logits(self.model, top)
        return last

    def _parallel_prefill(self) -> torch.Tensor:
        """K Jacobi passes over the whole prompt; the last fills the cache. Returns [W, B, D]."""
        fb = self.model.feedback
        embedded = self._embed(self.tokens, slice(0, self.width))
        mask = self._prefill_mask()
        passes = int(self.passes) if self._feeds_back() else 1
        slots = torch.arange(self.width, device=self.device).view(-1, 1)
        reset = slots <= self.first.view(1, -1)  # [W, B]: a sequence's first token (and padding before it)
        gate = self._token_gate(embedded, passes)
        top = None
        for k in range(passes):
            x = embedded if fb is None else fb.pass_input(top, embedded, gate, reset)
            self.context.sequence_len_offset = 0
            top = self._stack(x, mask, use_cache=k == passes - 1)
        self.prev_top = top.gather(0, self.last.view(1, -1, 1).expand(1, -1, top.shape[-1]))
        self.has_prev[:] = True
        return top

    @torch.no_grad()
    def step(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Append one token per sequence ([B]); returns the next-token logits [B, V]."""
        return full_vocab_logits(self.model, self._run_slot(token_ids))[:, 0]


@dataclass
class GenerationOutput:
    tokens: list[list[int]]  # generated ids per prompt (EOS / stop excluded)
    finish_reasons: list[str]  # "length", "eos" or "stop"
    logits: torch.Tensor | None = None  # [B, T, V] when return_logits (T = steps run)
    steps: int = 0


class FeedbackDecoder:
    """Decoding of an FBT model with a KV cache: ``mode`` feedback|standard, ``prefill_passes``."""

    def __init__(self, model: FBTGPTModel, mode: str = "feedback", prefill_passes=2):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {MODES}")
        self.model = model.eval()
        self.mode = mode if model.feedback is not None else "standard"
        self.prefill_passes = parse_prefill_passes(prefill_passes)

    def session(self, prompts, appended, padding: str = "left") -> DecodeSession:
        return DecodeSession(self.model, prompts, appended, mode=self.mode,
                             prefill_passes=self.prefill_passes, padding=padding)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None, *,
                 padding: str = "left", eos_id: int | None = None, vocab_limit: int | None = None,
                 is_stopped: Callable[[int, list[int]], bool] | None = None,
                 on_token: Callable[[int, int], None] | None = None,
                 return_logits: bool = False) -> GenerationOutput:
        """Sample up to ``params.max_new_tokens`` tokens after each prompt.

        ``vocab_limit`` masks ids the tokenizer does not have; ``is_stopped(b, ids)`` ends sequence b
        (stop strings); ``on_token(b, id)`` streams. Every TP rank draws the same tokens (same seed,
        gathered logits)."""
        params = params or SamplingParams()
        # the last sampled token is returned, never fed: max_new_tokens - 1 slots after the prompt
        session = self.session(prompts, params.max_new_tokens - 1, padding)
        generator = torch.Generator(device=session.device).manual_seed(int(params.seed))
        out = [[] for _ in prompts]
        reasons = ["length"] * len(prompts)
        active = [True] * len(prompts)
        kept = []
        logits = session.prefill()
        steps = 0
        for t in range(params.max_new_tokens):
            if vocab_limit is not None and vocab_limit < logits.shape[-1]:
                logits[:, vocab_limit:] = float("-inf")
            if return_logits:
                kept.append(logits)
            nxt = sample_next(logits, params, generator)
            steps += 1
            for b, tok in enumerate(nxt.tolist()):
                if not active[b]:
                    continue
                if eos_id is not None and tok == eos_id:
                    active[b], reasons[b] = False, "eos"
                    continue
                out[b].append(tok)
                if on_token is not None:
                    on_token(b, tok)
                if is_stopped is not None and is_stopped(b, out[b]):
                    active[b], reasons[b] = False, "stop"
            if not any(active) or t == params.max_new_tokens - 1:
                break
            logits = session.step(nxt)
        stacked = torch.stack(kept, dim=1) if return_logits else None
        return GenerationOutput(out, reasons, stacked, steps)

    @torch.no_grad()
    def score(self, contexts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
              padding: str = "left") -> list[tuple[float, bool]]:
        """Log-likelihood of each continuation after its context, decoded as generation would
        (prefill the context, then feed the continuation token by token with feedback), and
        whether it is the greedy continuation."""
        if any(len(c) == 0 for c in continuations):
            raise ValueError("an empty continuation has no log-likelihood")
        steps = max(len(c) for c in continuations)
        session = self.session(contexts, [len(c) - 1 for c in continuations], padding)
        logits = session.prefill()
        total = torch.zeros(len(contexts), dtype=torch.float64)
        greedy = [True] * len(contexts)
        for t in range(steps):
            logp = torch.log_softmax(logits.double(), dim=-1)
            forced = torch.tensor([c[t] if t < len(c) else 0 for c in continuations], device=logp.device)
            best = logp.argmax(-1)
            for b, c in enumerate(continuations):
                if t < len(c):
                    total[b] += float(logp[b, c[t]])
                    greedy[b] = greedy[b] and int(best[b]) == c[t]
            if t < steps - 1:
                logits = session.step(forced)
        return [(float(total[b]), greedy[b]) for b in range(len(contexts))]
