"""The FBT model inside vLLM: latent-feedback decoding with vLLM's own Llama stack, KV cache and scheduler.

vLLM runs a *flattened* batch: the scheduled tokens of every running request, one request's tokens after
the other (``query_start_loc``), each with its position and the KV-cache slot it writes
(``slot_mapping``, from the request's block table). A token's stack input is

- ``e_t`` (the plain first pass) at position 0 (``feedback.first_input: state`` checkpoints: ``fuse(h_init, e_t)``);
- ``fuse(h_{t-1}, e_t) = (W_U h') * sigmoid(W_G e_t)`` with ``h' = (1 - a) h_{t-1} + a h_init`` elsewhere,
  where ``h`` is the final-norm output (what the LM head reads).

**Where h_{t-1} comes from: a state cache beside the KV cache.** Every token's top state is written at the
token's own KV slot in a ``[slots, D]`` tensor (``FeedbackStates``), exactly as its keys and values are. A
token whose previous position was computed in an earlier step (a decode token; a prefill resumed after a
cached prefix or a chunk) reads ``h_{t-1}`` at the previous position's slot, found through the request's
block table as attention finds its keys. So the state follows vLLM's own cache bookkeeping: no request ids,
nothing to free (a freed block's states are overwritten with its next keys), and a request that vLLM
preempts and recomputes rebuilds its states as it rebuilds its keys. A decode-only step (one new token per
request: most steps) finds the previous slots with a few tensor ops (``decode_layout``); any other step goes
through ``step_layout``, which also checks the block table against the step's slot mapping.

**Prefill** (tokens whose previous position is in the same step): ``prefill_passes`` (config field; vLLM's
``--hf-overrides '{"prefill_passes": "exact"}'``):
- ``K`` (2, the export's default: the paper's FUSED prefill): K Jacobi passes over the step's tokens, pass k
  feeding each token the top state of the previous position from pass k-1; only the last pass's keys and
  values stay in the cache (each pass overwrites the step's slots);
- ``"exact"``: the recurrence itself. Passes are repeated until the states no longer change (at most the
  longest prompt in the step: after k passes the first k positions of each prompt are exact), which is the
  recurrence's unique solution; it gives the tokens of token-by-token prefill, whatever vLLM's scheduler does
  (chunks, prefix caching, preemption) but costs up to prompt-length passes over the prompt.
K passes over a prompt are defined over the whole prompt: a prompt split by chunked prefill, or resumed
after a cached prefix, would get other tokens than ``fbt generate``; the plugin's config hook turns both off
for a K-pass prefill (``vllm_config.FBTVllmConfig``). After a preemption vLLM recomputes prompt + generated
tokens as one prefill: exact prefill gives the same tokens. For K passes the plugin needs where the request's
prompt ends, which vLLM's attention metadata does not carry: it reads the prompt lengths from the model
runner's input batch (found when the model is built, ``_find_model_runner``; a stopgap, docs/serving.md),
runs the K passes over the prompt positions, then holds those inputs and repeats passes until the generated
positions' states stop changing (the recurrence they were decoded with). Without the runner the K passes
would run over the generated tokens too (logged at start-up).

``feedback_decoding: standard`` (config field) serves the model's first pass: token embeddings in, no fusion
(the ``--standard`` export in stock vLLM gives the same tokens without the plugin).

Only the Llama-class architecture is served (RMSNorm, SwiGLU, RoPE: vLLM's ``LlamaModel``); other exports are
refused naming the field. A setting outside its values (``SETTINGS``) is refused naming it and the values allowed.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

import torch
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.models.llama import LlamaForCausalLM

from fbt_megatron.model.feedback_rule import token_gate
from fbt_megatron.model.modeling_fbt import LatentFeedback as HFLatentFeedback

LLAMA_CLASS = {"norm_type": "RMSNorm", "mlp_gated": True, "position_embedding_type": "rope"}
SETTINGS = {  # field: (default, whether a value is served, the values served as the message names them)
    "feedback_fusion": ("glu", lambda v: v in ("glu", "additive", "off"), "'glu', 'additive' or 'off'"),
    "feedback_first_input": ("embedding", lambda v: v in ("embedding", "state"), "'embedding' or 'state'"),
    "feedback_gate_table": (True, lambda v: isinstance(v, bool), "true or false"),
    "feedback_decoding": ("feedback", lambda v: v in ("feedback", "standard"), "'feedback' or 'standard'"),
    "prefill_passes": (2, lambda v: v == "exact" or (type(v) is int and v >= 1), "an integer >= 1 or 'exact'"),
}


def check_servable(config) -> None:
    """Raise naming each config field the plugin cannot serve: an architecture field vLLM's Llama stack does not
    run, or a setting (the export's config or ``--hf-overrides``) outside the values the plugin serves."""
    arch = [f"{k}={getattr(config, k, v)!r} (served: {v!r})" for k, v in LLAMA_CLASS.items()
            if getattr(config, k, v) != v]
    if getattr(config, "qkv_bias", False) and not getattr(config, "attention_bias", False):
        arch.append("qkv_bias=True (served: false; vLLM's Llama puts attention biases on q/k/v and o_proj "
                    "together, and Qwen2-style q/k/v-only biases are not wired in the plugin)")
    values = {k: getattr(config, k, default) for k, (default, _, _) in SETTINGS.items()}
    bad = [f"{k}={values[k]!r} (allowed: {names})" for k, (_, ok, names) in SETTINGS.items() if not ok(values[k])]
    problems = (["serves Llama-class FBT exports only; this one has " + ", ".join(arch)] if arch else []) + \
               (["does not serve " + ", ".join(bad)] if bad else [])
    if problems:
        raise ValueError("the fbt_megatron vLLM plugin " + "; it also ".join(problems))


def refuse_lora(vllm_config) -> None:
    """Raise on ``--enable-lora`` with a feedback export: vLLM then wraps every linear layer in a LoRA layer,
    the fusion's feedback.value_proj and feedback.gate_proj included, and the feedback path under LoRA is
    untested. An export with ``feedback_fusion: off`` (no fusion) is served as vLLM's Llama is."""
    if vllm_config.lora_config is None:
        return
    if getattr(vllm_config.model_config.hf_config, "feedback_fusion", "glu") == "off":
        return
    raise NotImplementedError(
        "the fbt_megatron vLLM plugin does not serve LoRA adapters on a feedback export: with --enable-lora "
        "vLLM wraps every linear layer in a LoRA layer, the fusion's feedback.value_proj and feedback.gate_proj "
        "included, and the feedback path under LoRA is untested. Merge the adapter into the HF export's weights "
        "(PEFT's merge_and_unload, then save_pretrained) and serve that without --enable-lora, or serve the "
        "`--standard` export with LoRA in stock vLLM (standard decoding, no feedback)")


class LatentFeedback(HFLatentFeedback):
    """W_U (value_proj), W_G (gate_proj), h_init: the export modelling file's module (the same parameter
    names, so the export's ``feedback.*`` weights load as they are, and the same rule functions,
    ``model/feedback_rule.py``), on vLLM's flattened ``[N, D]`` tokens.
    The two projections are vLLM's ``ReplicatedLinear``, so they run on the GEMM vLLM picks for the platform,
    as the stack's layers do (on CPU its oneDNN kernel with prepacked weights, faster than torch's
    ``nn.Linear`` on decode rows: docs/results/benchmarks.md).

    The token's side of the fusion, ``token_gate`` = ``sigmoid(W_G e_t)`` (``W_G e_t`` for the additive
    fusion), is a function of the token id alone: with ``feedback_gate_table`` (config field, default true) it
    is computed once for the whole vocabulary when the weights load (:meth:`build_gate_table`) and a step reads
    its tokens' rows, so a token costs one D x D matmul (W_U's) instead of two. The table is a second
    ``[vocab, D]`` embedding table (16 MB for 4096 x 1024 in float32); ``--hf-overrides
    '{"feedback_gate_table": false}'`` computes the gate per token instead, as it does for inputs given as
    embeddings and under tensor parallelism (where each rank holds a slice of the vocabulary)."""

    def __init__(self, config, prefix: str = "feedback"):
        from vllm.model_executor.layers.linear import ReplicatedLinear

        super().__init__(config)
        self.prefix_mixin = float(config.feedback_prefix_mixin)
        d, bias = config.hidden_size, bool(getattr(config, "feedback_bias", False))
        self.value_proj = ReplicatedLinear(d, d, bias=bias, return_bias=False, prefix=f"{prefix}.value_proj")
        self.gate_proj = ReplicatedLinear(d, d, bias=bias, return_bias=False, prefix=f"{prefix}.gate_proj")
        # [vocab, D] token gates (build_gate_table), or None; a buffer, so it moves with the module
        self.register_buffer("gate_table", None, persistent=False)

    def build_gate_table(self, embeddings: torch.Tensor, gate_weight: torch.Tensor, gate_bias=None) -> None:
        """Every token's token_gate from the embedding table and W_G as loaded (the raw tensors: vLLM's CPU
        GEMM keeps only its prepacked copy of W_G)."""
        with torch.no_grad():
            gate = torch.nn.functional.linear(embeddings, gate_weight.to(embeddings),
                                              None if gate_bias is None else gate_bias.to(embeddings))
            self.gate_table = token_gate(gate, self.mode)

    def reads_table(self, input_ids) -> bool:
        return self.gate_table is not None and input_ids is not None

    def token_gate(self, emb, input_ids=None):
        """The parent's token_gate of ``emb``, read from the table's rows for ``input_ids`` where there is a
        table and the step has token ids (:meth:`reads_table`)."""
        if self.reads_table(input_ids):
            return self.gate_table[input_ids]
        return super().token_gate(emb)


class FeedbackStates:
    """Top states by KV slot: ``[slots, D]``, grown on demand (vLLM allocates the KV cache after the model is
    built, and the state cache needs one row per slot that is used)."""

    def __init__(self):
        self.tensor: torch.Tensor | None = None

    def ensure(self, slots: int, like: torch.Tensor) -> torch.Tensor:
        t = self.tensor
        if t is None or t.shape[0] < slots or t.dtype != like.dtype or t.device != like.device:
            grown = torch.zeros(max(slots, 2 * (t.shape[0] if t is not None else 0)), like.shape[-1],
                                dtype=like.dtype, device=like.device)
            if t is not None:
                grown[: t.shape[0]] = t.to(grown)
            self.tensor = t = grown
        return t


def slot_of(table: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """The KV slot of position ``pos`` of request row ``rows``, through the block table (as attention finds it)."""
    return table[rows, pos // block_size].long() * block_size + pos % block_size


def step_layout(meta, positions: torch.Tensor, block_size: int):
    """For the step's ``n`` real tokens: ``starts`` (the token's previous position is not in this step),
    ``prev_slot`` (for a start with position > 0: the slot holding h_{t-1}; -1 elsewhere), the longest
    run of tokens of one request and each token's request row. Checks that the block table gives the step's
    own slots (the layout the state cache relies on)."""
    n = int(meta.num_actual_tokens)
    qsl = meta.query_start_loc.long()
    lengths = qsl[1:] - qsl[:-1]
    req = torch.repeat_interleave(torch.arange(len(lengths), device=qsl.device), lengths)[:n]
    pos = positions[:n].long()
    starts = torch.zeros(n, dtype=torch.bool, device=pos.device)
    starts[qsl[:-1][lengths > 0]] = True
    table = meta.block_table
    own = slot_of(table, req, pos, block_size)
    if not torch.equal(own, meta.slot_mapping[:n].long()):
        raise RuntimeError("the attention metadata's block table does not give the step's slot mapping with "
                           f"block_size={block_size}: the feedback state cache cannot find previous positions")
    prev_slot = slot_of(table, req, (pos - 1).clamp_min(0), block_size)
    prev_slot = torch.where(starts & (pos > 0), prev_slot, torch.full_like(prev_slot, -1))
    return n, starts, prev_slot, int(lengths.max().item()) if len(lengths) else 0, req


def decode_layout(meta, positions: torch.Tensor, block_size: int):
    """A decode-only step (``max_query_len == 1``: one token per request row, row i = token i): for its ``n``
    tokens, the slot holding h_{t-1} (the token's own slot at position 0, where the caller takes the stateless
    input instead) and whether a previous position exists; a few tensor ops instead of :func:`step_layout`'s
    (most steps are decode steps). None for any other step (padded rows too): :func:`step_layout` then, whose
    block-table check every prefill step runs."""
    n = int(meta.num_actual_tokens)
    table = meta.block_table
    if getattr(meta, "max_query_len", None) != 1 or meta.query_start_loc.shape[0] != n + 1 or table.shape[0] < n:
        return None
    pos = positions[:n]
    return slot_of(table, torch.arange(n, device=table.device), (pos - 1).clamp_min(0), block_size), pos > 0


def _find_model_runner():
    """A weak reference to the vLLM model runner building this model (the caller frame whose ``self`` has an
    ``input_batch``: ``GPUModelRunner.load_model`` and the CPU runner's override), or None. A stopgap for
    the prompt lengths vLLM's attention metadata lacks; without it a K-pass prefill after a preemption runs
    its passes over the generated tokens too (docs/serving.md)."""
    import inspect
    import weakref

    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            if owner is not None and hasattr(owner, "input_batch") and hasattr(owner, "load_model"):
                return weakref.ref(owner)
            frame = frame.f_back
        return None
    finally:
        del frame


class FBTForCausalLM(LlamaForCausalLM):
    """vLLM's Llama with the latent-feedback fusion at the bottom of the stack (module docstring)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        config = vllm_config.model_config.hf_config
        check_servable(config)
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise NotImplementedError("the fbt_megatron vLLM plugin does not run pipeline parallelism (the last "
                                      "stage's top state would have to reach the first stage): use "
                                      "--pipeline-parallel-size 1")
        fusion = getattr(config, "feedback_fusion", "glu")
        refuse_lora(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.feedback = LatentFeedback(config, f"{prefix}.feedback" if prefix else "feedback") \
            if fusion != "off" else None
        self.decoding = getattr(config, "feedback_decoding", "feedback")
        self.prefill_passes = getattr(config, "prefill_passes", 2)
        self.block_size = vllm_config.cache_config.block_size
        self.states = FeedbackStates()
        self._layout_checked = False  # step_layout's block-table check has run once
        self.step_kinds = Counter()  # forwards by path: "stateless", "decode", "general" (read by the tests)
        self._runner = _find_model_runner()
        if self._runner is None and self.prefill_passes != "exact" and self.feedback is not None:
            logging.getLogger("fbt_megatron.serving").warning(
                "fbt_megatron plugin: vLLM's model runner not found: a request recomputed after a preemption "
                "gets K prefill passes over its generated tokens too (other tokens; docs/serving.md)")

    def _prompt_lengths(self, num_reqs: int, device) -> torch.Tensor | None:
        """Each request row's prompt length, from the model runner's input batch (whose rows are the attention
        metadata's): vLLM's attention metadata does not carry it (docs/serving.md). None where the runner
        was not found."""
        runner = self._runner() if self._runner is not None else None
        batch = getattr(runner, "input_batch", None)
        lengths = getattr(batch, "num_prompt_tokens", None)
        if lengths is None or getattr(batch, "num_reqs", -1) < num_reqs:
            return None
        return torch.as_tensor(lengths[:num_reqs]).to(device=device, dtype=torch.long)

    # ------------------------------------------------------------------ helpers
    def _stack(self, x, positions, intermediate_tensors):
        return self.model(None, positions, intermediate_tensors, x)

    @staticmethod
    def _metadata():
        meta = get_forward_context().attn_metadata
        if isinstance(meta, list):
            raise NotImplementedError("dual-batch overlap (a list of attention metadata) is not supported by "
                                      "the FBT plugin")
        if not meta:
            return None
        meta = next(iter(meta.values()))
        n = int(meta.num_actual_tokens)
        if n == 0 or bool((meta.slot_mapping[:n] < 0).any()):  # a warm-up or profiling run: no real slots
            return None
        return meta

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        fb = self.feedback
        if fb is None or (self.decoding == "standard" and fb.plain_first_pass):
            return self.model(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        if kwargs:
            raise NotImplementedError(f"the FBT plugin's forward takes no {sorted(kwargs)}")
        emb = inputs_embeds if inputs_embeds is not None else self.model.embed_input_ids(input_ids)
        ids = input_ids if inputs_embeds is None else None
        gate = fb.token_gate(emb, ids)  # sigmoid(W_G e_t) (glu), the same in every pass
        self.step_kinds["gate table" if fb.reads_table(ids) else "gate matmul"] += 1
        base = fb.stateless_input(emb, gate)
        meta = self._metadata()
        if self.decoding == "standard" or meta is None:  # the state rule's pass 1; vLLM's warm-up runs
            self.step_kinds["stateless"] += 1
            return self._stack(base, positions, intermediate_tensors)

        n = int(meta.num_actual_tokens)
        slots = meta.slot_mapping[:n].long()
        decode = decode_layout(meta, positions, self.block_size)
        # step_layout for every other step, and on the first decode step for its block-table check alone
        general = step_layout(meta, positions, self.block_size) if decode is None or not self._layout_checked \
            else None
        self._layout_checked = True
        prev_slot = decode[0] if decode is not None else general[2]
        # the bound counts the previous slots too: a block filled outside this engine's steps (a KV connector)
        # is an error here, not an index past the cache
        states = self.states.ensure(int(torch.maximum(slots.max(), prev_slot.max())) + 1, emb)
        if decode is not None:  # one new token per request (most steps): h_{t-1} from the cache, one pass
            carried = decode[1]
            fed = fb.stack_input(fb.fed_back(states[prev_slot]), emb[:n], gate[:n], ~carried)
            x = fed if base.shape[0] == n else torch.cat([fed, base[n:]])
            top = self._stack(x, positions, intermediate_tensors)
            states[slots] = top[:n].to(states.dtype)
            self.step_kinds["decode"] += 1
            return top

        _, starts, _, longest, req = general
        carried = prev_slot >= 0  # h_{t-1} from an earlier step
        x = base.clone()
        if bool(carried.any()):
            idx = carried.nonzero().squeeze(-1)
            x[idx] = fb.fuse(fb.fed_back(states[prev_slot[idx]]), gate[idx])
        inside = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        inside[:n] = ~starts  # h_{t-1} from this step's previous token
        # K passes run over prompt positions only: a request recomputed after a preemption also brings its
        # generated tokens, which were decoded by the recurrence (after the prompt's K passes)
        generated = torch.zeros_like(inside)
        if self.prefill_passes != "exact" and bool(inside.any()):
            plen = self._prompt_lengths(len(meta.query_start_loc) - 1, x.device)
            if plen is not None:
                generated[:n] = positions[:n].long() >= plen[req]
        if not bool(inside.any()):
            passes = 1
        elif self.prefill_passes == "exact":
            passes = longest
        else:
            passes = int(self.prefill_passes)
            if bool((generated & inside).any()):  # then the recurrence over the generated tokens
                passes += longest
        top = self._stack(x, positions, intermediate_tensors)
        done = 1
        idx = inside.nonzero().squeeze(-1)
        frozen = (inside & ~generated)[idx]  # prompt positions: their K-th pass input stays after pass K
        x_k = x
        while done < passes:
            fed = fb.fuse(fb.fed_back(top[idx - 1]), gate[idx])
            if done >= int(self.prefill_passes if self.prefill_passes != "exact" else passes):
                fed = torch.where(frozen.unsqueeze(-1), x_k[idx], fed)
            x_k = x_k.clone()
            x_k[idx] = fed
            new_top = self._stack(x_k, positions, intermediate_tensors)
            done += 1
            converged = (self.prefill_passes == "exact" or done > int(self.prefill_passes)) and \
                torch.equal(new_top[:n], top[:n])
            top = new_top
            if converged:  # the recurrence's fixed point: further passes change nothing
                break
        self.step_kinds["general"] += 1
        states[slots] = top[:n].to(states.dtype)
        return top

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        weights = list(weights)
        if self.feedback is None:
            return super().load_weights(weights)
        names = {f"feedback.{k}" for k, _ in self.feedback.named_parameters()}
        own = {k: v for k, v in weights if k in names}
        missing = names - set(own)
        if missing:
            raise ValueError(f"the export has no {sorted(missing)}: not an FBT export with feedback_fusion="
                             f"{self.feedback.mode!r}")
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        with torch.no_grad():  # through each parameter's loader, as vLLM's layers load (and reload) theirs
            for k, p in self.feedback.named_parameters():
                getattr(p, "weight_loader", default_weight_loader)(p, own[f"feedback.{k}"].to(p.dtype))
        loaded = super().load_weights((k, v) for k, v in weights if k not in names)
        self.feedback.gate_table = None
        embeddings = getattr(self.model.embed_tokens, "weight", None)
        if (getattr(self.config, "feedback_gate_table", True) and get_tensor_model_parallel_world_size() == 1
                and embeddings is not None and embeddings.shape[0] >= self.config.vocab_size):
            self.feedback.build_gate_table(embeddings, own["feedback.gate_proj.weight"], own.get("feedback.gate_proj.bias"))
        return set(loaded) | names
