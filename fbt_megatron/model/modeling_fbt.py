"""Full-bandwidth transformer (latent feedback) for Hugging Face transformers.

This file is shipped inside every `fbt convert to-hf` export and loaded with
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``. It depends only on torch, transformers
and its sibling ``feedback_rule.py`` (shipped with it: the feedback rule the Megatron model and the vLLM plugin
call too; transformers copies a remote-code file's relative imports with it). The stack is transformers' own
Llama (``LlamaModel``: attention, rotary embedding, KV cache, masks; ``GenerationMixin``: ``generate``), with
three additions:

- architecture variants of the Megatron GPT the checkpoint was trained as, chosen by config fields:
  ``norm_type`` (RMSNorm or LayerNorm), ``mlp_gated`` (SwiGLU or a plain ``act(up)`` -> ``down`` MLP),
  ``position_embedding_type`` (rope or learned absolute positions added to the token embedding),
  ``qkv_bias`` (biases on the q/k/v projections only, as Qwen2);
- the latent feedback fusion: ``x_t = (W_U s_t) * sigmoid(W_G e_t)`` (``feedback_fusion="glu"``) or
  ``W_U s_t + W_G e_t`` (``"additive"``), where ``s_t = (1 - a) h_{t-1} + a h_init`` is the fed-back
  top state (prefix mixin ``a``; ``h`` is the final-norm output). Where no previous state exists
  (pass 1, position 0, the first token of a left-padded row) the stack reads the token embedding
  ``e_t`` (``feedback_first_input="embedding"``: pass 1 is the plain Llama) or, in checkpoints trained
  with the ``"state"`` ablation, ``fuse(h_init, e_t)``;
- a forward with a number of passes (multi-pass teacher forcing = Jacobi iteration of the
  recurrence), and generation with feedback through the KV cache.

Forward: ``model(input_ids, num_passes=k)`` runs k passes over the sequence (default
``config.forward_passes``) and returns the last pass's logits.

Generation (``model.generate(...)``) keyword options, defaults from the config:
- ``feedback_decoding="feedback"``: each new token's stack input fuses the previous token's top state
  (carried between steps as ``feedback_state``) with its embedding; ``"standard"`` decodes without
  feedback (the model's 1-pass behaviour: with the embedding rule, exactly ``LlamaForCausalLM`` on the
  same weights), for comparison;
- ``prefill_passes``: an integer K runs K fused passes over the whole prompt (K=2 is the paper's
  FUSED prefill, the exporter's default; the cache then holds the last pass's keys and values);
  ``"exact"`` runs the prompt token by token through the cache (the exact recurrence).
Greedy search and sampling are supported, with or without the KV cache (``use_cache=False`` recomputes
the same prefill and recurrence from scratch at every step: the same tokens, slower); beam search is
refused (``num_beams > 1`` raises: the fed-back state is not reordered with the beams).

Works with transformers 4.57 and every 5.x: the cache is named ``past_key_values`` up to 5.23 and
``cache`` from 5.24 on, in model inputs and outputs alike; both are accepted, and the output carries
the name the running transformers uses.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import (
    LlamaForCausalLM,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
)

from .feedback_rule import (
    FIRST_INPUTS,
    attended_starts,
    fuse,
    mix,
    reset_positions,
    shifted_states,
    stack_input,
    stateless_input,
    token_gate,
)

# The KV cache's name in this transformers (``cache`` from 5.24, ``past_key_values`` before).
CACHE_FIELD = "cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)} else "past_key_values"
STACK_CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"

FUSIONS = ("glu", "additive", "off")
DECODINGS = ("feedback", "standard")


class FBTConfig(LlamaConfig):
    """A Llama config plus the fields that describe the FBT checkpoint's variants and feedback."""

    model_type = "fbt_llama"

    norm_type: str = "RMSNorm"  # or "LayerNorm" (with bias), eps = rms_norm_eps
    mlp_gated: bool = True  # SwiGLU (Llama) or a plain up -> act -> down MLP (GPT)
    position_embedding_type: str = "rope"  # or "learned_absolute"
    qkv_bias: bool = False  # biases on q/k/v only (Qwen2); attention_bias puts them on o_proj too
    feedback_fusion: str = "glu"
    feedback_bias: bool = False
    feedback_prefix_mixin: float = 0.0
    feedback_first_input: str = "embedding"  # where no previous state exists: "embedding" or "state"
    forward_passes: int = 1  # fused passes of a plain forward (teacher forcing)
    feedback_decoding: str = "feedback"  # generate(): "feedback" or "standard"
    prefill_passes: int | str = "exact"  # generate(): "exact" or a number of fused passes
    fbt: dict | None = None  # provenance: recipe, tokens seen, pass mix (written by the exporter)


@dataclass
class FBTCausalLMOutput(CausalLMOutputWithPast):
    feedback_state: torch.Tensor | None = None  # [B, D] top state at the last position
    pass_residuals: list | None = None  # ||h^k - h^{k-1}|| / ||h^{k-1}|| for k = 2..passes
    feedback_prompt_length: int | None = None  # generate() without a cache: where the prompt ends


# ---------------------------------------------------------------------- layer variants
def make_norm(config: FBTConfig) -> nn.Module:
    if config.norm_type == "RMSNorm":
        return LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    if config.norm_type == "LayerNorm":
        return nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)
    raise ValueError(f"norm_type={config.norm_type!r} is not one of ('RMSNorm', 'LayerNorm')")


class PlainMLP(nn.Module):
    """GPT MLP: down(act(up x)) (Megatron's non-gated MLP)."""

    def __init__(self, config: FBTConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)))


class NoRotary(nn.Module):
    """cos = 1, sin = 0: Llama attention's rotary step becomes the identity (learned positions)."""

    def __init__(self, config: FBTConfig):
        super().__init__()
        self.head_dim = config.head_dim

    def forward(self, x, position_ids):
        shape = (*position_ids.shape, self.head_dim)
        return (torch.ones(shape, dtype=x.dtype, device=x.device),
                torch.zeros(shape, dtype=x.dtype, device=x.device))


VLLM_PLUGIN_HINT = ("this is an FBT export with latent feedback: vLLM serves it with the fbt_megatron vLLM plugin "
                    "(`pip install fbt_megatron` into vLLM's environment registers it as the vllm.general_plugins "
                    "entry point 'fbt'; docs/serving.md). Without the plugin vLLM's Transformers backend would "
                    "run the stack without the feedback state (other tokens). A `fbt convert to-hf --standard` "
                    "export (a plain Llama) needs no plugin.")


class FBTModel(LlamaModel):
    """transformers' LlamaModel with the norm / MLP / position variants the config names. It is also the
    config's ``AutoModel``: vLLM's Transformers backend (used for an architecture vLLM does not know, i.e.
    without the fbt_megatron plugin) builds ``AutoModel`` with ``attn_implementation="vllm"``, which is
    refused naming the plugin instead of serving the stack without feedback."""

    config_class = FBTConfig

    def __init__(self, config: FBTConfig):
        if getattr(config, "_attn_implementation", None) == "vllm":
            raise ValueError(VLLM_PLUGIN_HINT)
        super().__init__(config)
        for layer in self.layers:
            layer.input_layernorm = make_norm(config)
            layer.post_attention_layernorm = make_norm(config)
            if not config.mlp_gated:
                layer.mlp = PlainMLP(config)
            if config.qkv_bias and not config.attention_bias:
                attn = layer.self_attn
                for name in ("q_proj", "k_proj", "v_proj"):
                    old = getattr(attn, name)
                    setattr(attn, name, nn.Linear(old.in_features, old.out_features, bias=True))
        self.norm = make_norm(config)
        if config.position_embedding_type == "learned_absolute":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
            self.rotary_emb = NoRotary(config)
        elif config.position_embedding_type != "rope":
            raise ValueError(f"position_embedding_type={config.position_embedding_type!r} is not one of "
                             "('rope', 'learned_absolute')")
        self.post_init()

    def embed(self, input_ids, position_ids):
        emb = self.embed_tokens(input_ids)
        if self.config.position_embedding_type == "learned_absolute":
            emb = emb + self.embed_positions(position_ids)
        return emb


class LatentFeedback(nn.Module):
    """W_U (value_proj, on the fed-back state), W_G (gate_proj, on the token embedding), h_init; the rule's
    functions (``feedback_rule.py``) applied with them, in any layout whose last axis is D."""

    def __init__(self, config: FBTConfig):
        super().__init__()
        d = config.hidden_size
        self.mode = config.feedback_fusion
        self.prefix_mixin = config.feedback_prefix_mixin
        self.first_input = config.feedback_first_input
        self.value_proj = nn.Linear(d, d, bias=config.feedback_bias)
        self.gate_proj = nn.Linear(d, d, bias=config.feedback_bias)
        self.initial_state = nn.Parameter(torch.zeros(d))
        self.plain_first_pass = self.first_input == "embedding"

    def token_gate(self, emb):
        """sigmoid(W_G e) (glu) or W_G e (additive): the same in every pass and step, computed once."""
        return token_gate(self.gate_proj(emb), self.mode)

    def fed_back(self, top):
        """(1 - a) h + a h_init: what of a top state reaches the next position."""
        return mix(top, self.initial_state, self.prefix_mixin)

    def shift_states(self, top, reset):
        """[B, S, D] top states of a pass -> the fed-back state each position receives (h_init where ``reset``)."""
        return shifted_states(self.fed_back(top), reset, self.initial_state, dim=1)

    def stateless_input(self, emb, token_gate):
        """The input where no previous state exists: e_t, or fuse(h_init, e_t) under the state rule."""
        return stateless_input(emb, token_gate, self.initial_state, self.first_input, self.fuse)

    def stack_input(self, state, emb, token_gate, reset):
        """fuse(state, e) where a state exists, the stateless input where ``reset``."""
        return stack_input(state, emb, token_gate, reset, self.initial_state, self.first_input, self.fuse)

    def fuse(self, state, token_gate):
        """(W_U state) * token_gate (glu) or + token_gate (additive); ``state`` [..., D] or broadcastable."""
        return fuse(self.value_proj(state), token_gate, self.mode)


# ---------------------------------------------------------------------- the causal LM
class FBTForCausalLM(LlamaForCausalLM):
    config_class = FBTConfig
    _no_split_modules = ["LlamaDecoderLayer"]

    def __init__(self, config: FBTConfig):
        if config.feedback_fusion not in FUSIONS:
            raise ValueError(f"feedback_fusion={config.feedback_fusion!r} is not one of {FUSIONS}")
        if config.feedback_first_input not in FIRST_INPUTS:
            raise ValueError(f"feedback_first_input={config.feedback_first_input!r} is not one of {FIRST_INPUTS}")
        LlamaPreTrainedModel.__init__(self, config)
        self.model = FBTModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.feedback = LatentFeedback(config) if config.feedback_fusion != "off" else None
        self.post_init()

    def _init_weights(self, module):
        """Fresh values for the modules LlamaPreTrainedModel does not know. A tensor loaded from the
        checkpoint is left alone: transformers 5.x calls this after loading and marks loaded tensors
        ``_is_hf_initialized`` (its own init functions skip them; 5.0 re-initialised h_init without this)."""
        super()._init_weights(module)
        fresh = lambda t: not getattr(t, "_is_hf_initialized", False)  # noqa: E731
        with torch.no_grad():
            if isinstance(module, LatentFeedback) and fresh(module.initial_state):  # unit scale, like a norm output
                module.initial_state.normal_(0.0, 1.0)
            elif isinstance(module, nn.LayerNorm):
                if fresh(module.weight):
                    module.weight.fill_(1.0)
                if module.bias is not None and fresh(module.bias):
                    module.bias.zero_()

    # ------------------------------------------------------------------ the recurrence's pieces
    @staticmethod
    def _reset(attention_mask, past: int, batch: int, seq: int, device) -> torch.Tensor:
        """[B, S] bool: positions whose state is h_init: position 0, or the first attended token of a
        left-padded row."""
        if attention_mask is None:
            if past:  # a continued sequence: every position has a previous one
                return torch.zeros(batch, seq, dtype=torch.bool, device=device)
            return reset_positions(None, (batch, seq), 1, device)
        return attended_starts(attention_mask.bool(), 1)[:, past:past + seq]

    def _positions(self, attention_mask, past: int, batch: int, seq: int, device):
        if attention_mask is not None:  # left padding: count only attended tokens
            pos = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
            return pos[:, past:past + seq]
        return torch.arange(past, past + seq, device=device).expand(batch, -1)

    def _stack(self, x, attention_mask, position_ids, cache, **kwargs):
        kwargs[STACK_CACHE_ARG] = cache
        out = self.model(inputs_embeds=x, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=cache is not None, **kwargs)
        return out.last_hidden_state

    def _jacobi(self, emb, gate, reset, attention_mask, position_ids, cache, passes: int, **kwargs):
        """``passes`` passes over the whole sequence; the last one fills ``cache`` if given. ``gate``: the
        token_gate of ``emb``."""
        fb = self.feedback
        top, residuals = None, []
        for k in range(passes):
            if k == 0:
                x = fb.stateless_input(emb, gate)
            else:
                x = fb.stack_input(fb.shift_states(top, reset), emb, gate, reset)
            last = k == passes - 1
            new_top = self._stack(x, attention_mask, position_ids, cache if last else None, **kwargs)
            if top is not None:
                residuals.append((new_top - top).norm() / top.norm().clamp_min(1e-12))
            top = new_top
        return top, residuals

    def _recurrent(self, emb, gate, reset, attention_mask, position_ids, cache, prev_state, past: int, **kwargs):
        """The exact recurrence, one token at a time through the KV cache."""
        fb = self.feedback
        tops = []
        for t in range(emb.shape[1]):
            e_t, g_t = emb[:, t:t + 1], gate[:, t:t + 1]
            if prev_state is None:
                x = fb.stateless_input(e_t, g_t)
            else:
                x = fb.stack_input(fb.fed_back(prev_state)[:, None], e_t, g_t, reset[:, t:t + 1])
            mask = attention_mask[:, : past + t + 1] if attention_mask is not None else None
            top = self._stack(x, mask, position_ids[:, t:t + 1], cache, **kwargs)
            prev_state = top[:, 0]
            tops.append(top)
        return torch.cat(tops, dim=1)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, num_passes: int | None = None,
                feedback_state: torch.Tensor | None = None, feedback_decoding: str | None = None,
                prefill_passes: int | str | None = None, feedback_prompt_length: int | None = None,
                fbt_generating: bool = False, **kwargs) -> FBTCausalLMOutput:
        """``num_passes``: fused passes over the sequence (teacher forcing; default
        ``config.forward_passes``, with or without ``use_cache``). Inside ``generate``
        (``fbt_generating``, set by ``prepare_inputs_for_generation``): ``feedback_state`` is the previous
        token's top state, ``feedback_decoding`` and ``prefill_passes`` choose the decoding (see the
        module docstring), ``feedback_prompt_length`` is where the prompt ends (used without a cache).
        ``cache`` / ``past_key_values``: the KV cache under either transformers name."""
        if input_ids is None:
            raise ValueError("FBTForCausalLM needs input_ids (the fusion gates on token embeddings)")
        cache = past_key_values if cache is None else cache
        kwargs.pop("cache_position", None)  # (transformers < 5.24) the stack derives it from the cache
        batch, seq = input_ids.shape
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None and not self.training:
            cache = DynamicCache(config=self.config)
        if not use_cache:
            cache = None
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = self._positions(attention_mask, past, batch, seq, input_ids.device)
        emb = self.model.embed(input_ids, position_ids)
        decoding = feedback_decoding or self.config.feedback_decoding
        if decoding not in DECODINGS:
            raise ValueError(f"feedback_decoding={decoding!r} is not one of {DECODINGS}")
        # A fresh sequence runs `num_passes`, else `prefill_passes` when generating (the prompt's
        # prefill), else `forward_passes` (the documented forward, whatever use_cache is).
        if num_passes is not None:
            spec = num_passes
        elif fbt_generating:
            spec = prefill_passes or self.config.prefill_passes
        else:
            spec = self.config.forward_passes

        residuals, prompt_length = [], None
        if self.feedback is None or (decoding == "standard" and self.feedback.plain_first_pass):
            top = self._stack(emb, attention_mask, position_ids, cache, **kwargs)  # the plain Llama / GPT
        else:
            gate = self.feedback.token_gate(emb)  # sigmoid(W_G e): the same in every pass and step
            reset = self._reset(attention_mask, past, batch, seq, input_ids.device)
            if decoding == "standard":  # the state rule's 1-pass behaviour: every state is h_init
                top = self._stack(self.feedback.stateless_input(emb, gate), attention_mask, position_ids, cache,
                                  **kwargs)
            elif fbt_generating and cache is None:
                # generate(use_cache=False): the whole sequence again, computed as the cached path does
                # (the prompt's prefill, then the recurrence token by token) in a cache of this call's own.
                prompt_length = feedback_prompt_length or seq
                scratch = DynamicCache(config=self.config)
                p = prompt_length
                top, residuals = self._fresh(emb[:, :p], gate[:, :p], reset[:, :p],
                                             attention_mask[:, :p] if attention_mask is not None else None,
                                             position_ids[:, :p], scratch, spec, **kwargs)
                if seq > p:
                    rest = self._recurrent(emb[:, p:], gate[:, p:], reset[:, p:], attention_mask,
                                           position_ids[:, p:], scratch, top[:, -1], p, **kwargs)
                    top = torch.cat([top, rest], dim=1)
            elif past > 0 or feedback_state is not None:  # continuing: the recurrence, step by step
                if feedback_state is None:
                    raise ValueError("feedback decoding past a cached prefix needs feedback_state (the "
                                     "previous token's top state, returned as outputs.feedback_state)")
                top = self._recurrent(emb, gate, reset, attention_mask, position_ids, cache, feedback_state, past,
                                      **kwargs)
            else:  # a fresh sequence: fused passes (teacher forcing / FUSED prefill) or exact prefill
                top, residuals = self._fresh(emb, gate, reset, attention_mask, position_ids, cache, spec, **kwargs)

        hidden = top[:, -logits_to_keep:] if isinstance(logits_to_keep, int) and logits_to_keep else top
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return FBTCausalLMOutput(loss=loss, logits=logits, feedback_state=top[:, -1], pass_residuals=residuals,
                                 feedback_prompt_length=prompt_length, **{CACHE_FIELD: cache})

    def _fresh(self, emb, gate, reset, attention_mask, position_ids, cache, spec, **kwargs):
        """A sequence from its start: ``spec`` fused passes, or ``"exact"`` (the recurrence)."""
        if spec == "exact":
            return self._recurrent(emb, gate, reset, attention_mask, position_ids, cache, None, 0, **kwargs), []
        if isinstance(spec, bool) or not isinstance(spec, int) or spec < 1:
            raise ValueError(f"passes={spec!r} is invalid; allowed: an integer >= 1 or 'exact'")
        return self._jacobi(emb, gate, reset, attention_mask, position_ids, cache, spec, **kwargs)

    # ------------------------------------------------------------------ generation
    def generate(self, *args, **kwargs):
        """transformers' ``generate``; refuses beam search (the fed-back state is not reordered)."""
        config = kwargs.get("generation_config") or self.generation_config
        beams = kwargs.get("num_beams", getattr(config, "num_beams", 1)) or 1
        if beams > 1:
            raise ValueError(f"num_beams={beams}: beam search is not supported by FBTForCausalLM (the fed-back "
                             "top state is not reordered with the beams); use num_beams=1 (greedy or sampling)")
        return super().generate(*args, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
        inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        inputs["fbt_generating"] = True  # a fresh sequence is the prompt: prefill_passes, not forward_passes
        if not inputs.get("use_cache", True) or kwargs.get("use_cache") is False:
            inputs["input_ids"] = input_ids  # without a cache every step sees the whole sequence
        return inputs

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, is_encoder_decoder=False,
                                            num_new_tokens=1):
        model_kwargs = super()._update_model_kwargs_for_generation(outputs, model_kwargs, is_encoder_decoder,
                                                                  num_new_tokens)
        model_kwargs["feedback_state"] = outputs.feedback_state  # h_{t-1} for the next token's fusion
        if outputs.feedback_prompt_length is not None:
            model_kwargs["feedback_prompt_length"] = outputs.feedback_prompt_length
        return model_kwargs


FBTConfig.register_for_auto_class()
FBTForCausalLM.register_for_auto_class("AutoModelForCausalLM")
