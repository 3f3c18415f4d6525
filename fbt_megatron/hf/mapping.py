"""The two tables that define the conversion, both driven by the recipe's model/feedback config.

``OPTIONS``: recipe option <-> fields of the HF config (``modeling_fbt.FBTConfig``, a LlamaConfig).
Options are read with a default (Megatron's behaviour when the recipe's ModelConfig has no such
field), so an architecture option added to ModelConfig later costs one row here; on import an HF
value that needs an option this ModelConfig lacks is refused by name.

``weight_rows(cfg)``: checkpoint tensor <-> HF tensor(s), with the global (TP=1) shape the checkpoint
must hold and how to transform it. Megatron stores per-layer tensors stacked on a leading layer axis
under one key (``gpt.decoder.layers.<...>``, global layer numbers, so PP stages map to the same keys),
and TP shards are placed by their global offsets, so a reader of the global tensor needs no TP logic.
Layouts to undo:
- fused QKV: rows are grouped per query group g as [q heads of g, k_g, v_g] (each head_dim rows);
- SwiGLU fc1: [all gate rows; all up rows] (Megatron's swiglu sharded factory stores it so);
- vocabulary: rows padded past the tokenizer's vocabulary (``vocab_pad_multiple``) are dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fbt_megatron.errors import UserError
from fbt_megatron.config import LEGACY_FIRST_INPUT, FeedbackConfig, ModelConfig

LAYERS = "gpt.decoder.layers."


class ConversionError(UserError, ValueError):
    """A checkpoint or HF directory that cannot be converted; the message names what and why."""


# ---------------------------------------------------------------------- config options
@dataclass(frozen=True)
class Option:
    section: str  # "model" or "feedback"
    name: str  # the recipe field
    default: Any  # its value when the config has no such field (Megatron's behaviour)
    to_hf: Callable[[Any, dict], dict]  # (value, recipe section values) -> HF fields
    from_hf: Callable[[dict], Any]  # HF config dict -> value (a stock Llama config lacks FBT fields)


def _same(hf: str, stock=None):
    """One HF field of the same value; ``stock``: its meaning when a stock Llama config lacks it."""
    return dict(to_hf=lambda v, m: {hf: v}, from_hf=lambda c: c.get(hf, stock))


ROPE_SCALING_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope(v, m):
    """transformers 5 reads ``rope_parameters``, 4.x ``rope_theta`` (and ``rope_scaling`` for Llama 3's
    scaled RoPE): all are written."""
    theta = float(v)
    scaling = m.get("rope_scaling")
    if not scaling:
        return {"rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    llama3 = {"rope_type": "llama3", **{k: scaling[k] for k in ROPE_SCALING_FIELDS}}
    return {"rope_theta": theta, "rope_scaling": llama3, "rope_parameters": {**llama3, "rope_theta": theta}}


def _rope_dicts(c) -> list[tuple[str, dict]]:
    """(field, dict) of the RoPE settings present: 4.x writes ``rope_scaling``, 5.x ``rope_parameters``.
    Only plain RoPE and Llama 3's ``llama3`` scaling convert; another (``linear``, ``dynamic``, ``yarn``,
    ...) is refused by name: keeping only the base would change the model."""
    out = []
    for key in ("rope_scaling", "rope_parameters"):
        rope = c.get(key) or {}
        if not isinstance(rope, dict):
            raise ConversionError(f"{key}={rope!r}: only plain RoPE or rope_type 'llama3' converts (a dict)")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise ConversionError(f"{key}.rope_type={kind!r} ({key}={rope}): this scaled RoPE has no fbt_megatron "
                                  "equivalent, so the model would change; allowed: 'default', 'llama3'")
        out.append((key, rope))
    return out


def _rope_from(c):
    """The RoPE base (theta)."""
    _rope_dicts(c)
    rope = c.get("rope_parameters") or {}
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    return int(theta) if float(theta).is_integer() else theta


def _rope_scaling_from(c):
    """Llama 3's scaling parameters (``rope_type: llama3``), or None for plain RoPE."""
    for key, rope in _rope_dicts(c):
        if rope.get("rope_type", rope.get("type")) == "llama3":
            missing = [k for k in ROPE_SCALING_FIELDS if k not in rope]
            if missing:
                raise ConversionError(f"{key} (rope_type 'llama3') lacks {missing}")
            return {k: rope[k] for k in ROPE_SCALING_FIELDS}
    return None


OPTIONS: list[Option] = [
    Option("model", "num_layers", None, **_same("num_hidden_layers")),
    Option("model", "hidden_size", None, **_same("hidden_size")),
    Option("model", "num_attention_heads", None, **_same("num_attention_heads")),
    Option("model", "num_query_groups", None,
           to_hf=lambda v, m: {"num_key_value_heads": v or m["num_attention_heads"]},
           from_hf=lambda c: None if c.get("num_key_value_heads") in (None, c["num_attention_heads"])
           else c["num_key_value_heads"]),
    Option("model", "ffn_hidden_size", None,
           to_hf=lambda v, m: {"intermediate_size": v or 4 * m["hidden_size"]},
           from_hf=lambda c: c["intermediate_size"]),
    Option("model", "activation", "gelu",
           to_hf=lambda v, m: {"mlp_gated": v == "swiglu", "hidden_act": "silu" if v == "swiglu" else "gelu"},
           from_hf=lambda c: _activation_from(c)),
    Option("model", "add_bias_linear", True,
           to_hf=lambda v, m: {"attention_bias": v, "mlp_bias": v},
           from_hf=lambda c: _bias_from(c)),
    # Qwen2's q/k/v biases (families.py sets the field for a stock qwen2 config)
    Option("model", "add_qkv_bias", False, **_same("qkv_bias", False)),
    Option("model", "vocab_size", None, **_same("vocab_size")),
    Option("model", "max_sequence_length", None, **_same("max_position_embeddings")),
    Option("model", "position_embedding_type", "rope", **_same("position_embedding_type", "rope")),
    Option("model", "rotary_base", 10000, to_hf=_rope, from_hf=_rope_from),
    Option("model", "rope_scaling", None, to_hf=lambda v, m: {}, from_hf=_rope_scaling_from),  # written by _rope
    Option("model", "normalization", "LayerNorm", **_same("norm_type", "RMSNorm")),
    Option("model", "norm_epsilon", 1e-5, **_same("rms_norm_eps")),
    Option("model", "tie_embeddings", True, **_same("tie_word_embeddings", False)),
    Option("model", "init_method_std", 0.02, **_same("initializer_range")),
    Option("feedback", "fusion", "glu", **_same("feedback_fusion", "off")),
    Option("feedback", "bias", False, **_same("feedback_bias", False)),
    Option("feedback", "prefix_mixin", 0.1, **_same("feedback_prefix_mixin", 0.0)),
    # Exports write W_U as the bounded mixin applies it (hf/export.as_applied); the field carries the
    # mixin back on import, so continued training keeps the bound.
    Option("feedback", "mixin", "affine", **_same("feedback_mixin", "affine")),
    # An export written before the field existed was trained with the state rule.
    Option("feedback", "first_input", "embedding", **_same("feedback_first_input", LEGACY_FIRST_INPUT)),
]
# Fields of the FBT config that a plain LlamaConfig does not have (left out of a --standard export).
FBT_ONLY_FIELDS = ("norm_type", "mlp_gated", "qkv_bias", "position_embedding_type", "feedback_fusion", "feedback_bias",
                   "feedback_prefix_mixin", "feedback_first_input", "feedback_mixin")


def check_llama_class(model: ModelConfig, feedback: FeedbackConfig) -> None:
    """A checkpoint whose standard decoding transformers' own LlamaForCausalLM computes: the Llama
    block, and a first pass that reads token embeddings. Refuses naming what differs."""
    wrong = [f"model.{name}={getattr(model, name)!r} (Llama: {want!r})" for name, want in
             (("activation", "swiglu"), ("normalization", "RMSNorm"), ("position_embedding_type", "rope"))
             if getattr(model, name) != want]
    if feedback.fusion != "off" and feedback.first_input != "embedding":
        wrong.append(f"feedback.first_input={feedback.first_input!r} (its 1-pass model fuses h_init: only "
                     "'embedding' makes standard decoding the plain Llama)")
    if wrong:
        raise ConversionError("--standard writes a plain LlamaForCausalLM checkpoint, but this recipe is not "
                              "Llama-class: " + "; ".join(wrong))


def _activation_from(c: dict) -> str:
    gated, act = c.get("mlp_gated", True), c.get("hidden_act", "silu")
    if gated and act == "silu":
        return "swiglu"
    if not gated and act == "gelu":
        return "gelu"
    raise ConversionError(f"MLP (mlp_gated={gated}, hidden_act={act!r}) has no fbt_megatron equivalent; "
                          "allowed: gated silu (SwiGLU) or non-gated gelu")


def _bias_from(c: dict) -> bool:
    attn, mlp = bool(c.get("attention_bias", False)), bool(c.get("mlp_bias", False))
    if attn != mlp:
        raise ConversionError(f"attention_bias={attn} but mlp_bias={mlp}: Megatron's add_bias_linear covers "
                              "both; allowed: equal values")
    return attn


def _section_values(cfg) -> dict:
    return cfg.model_dump() if hasattr(cfg, "model_dump") else dict(cfg)


def option_value(cfg, opt: Option):
    return getattr(cfg, opt.name, opt.default)


def hf_config_fields(model: ModelConfig, feedback: FeedbackConfig) -> dict:
    """The HF config fields of a recipe's model and feedback sections (table ``OPTIONS``)."""
    sections = {"model": model, "feedback": feedback}
    values = {"model": _section_values(model), "feedback": _section_values(feedback)}
    out: dict = {}
    for opt in OPTIONS:
        out.update(opt.to_hf(option_value(sections[opt.section], opt), values[opt.section]))
    out["head_dim"] = model.hidden_size // model.num_attention_heads
    out["attention_dropout"] = 0.0
    return out


def recipe_sections(hf: dict) -> tuple[dict, dict]:
    """(model, feedback) recipe sections from an HF config dict (ours, or a stock Llama's: fields the
    FBT config adds then take their Llama meaning, e.g. RMSNorm, SwiGLU, no fusion). Refuses values
    this ModelConfig cannot hold, naming the option."""
    sections: dict = {"model": {}, "feedback": {}}
    fields = {"model": ModelConfig.model_fields, "feedback": FeedbackConfig.model_fields}
    for opt in OPTIONS:
        value = opt.from_hf(hf)
        if opt.name in fields[opt.section]:
            sections[opt.section][opt.name] = value
        elif value != opt.default:
            raise ConversionError(
                f"{opt.section}.{opt.name}={value!r} (from the HF config) is needed, but this fbt_megatron's "
                f"{opt.section} config has no {opt.name!r} option (only {opt.default!r} is possible)")
    return sections["model"], sections["feedback"]


# ---------------------------------------------------------------------- weights
@dataclass(frozen=True)
class Row:
    key: str  # checkpoint (Megatron sharded-state-dict) key
    hf: tuple[str, ...]  # HF name(s); "{i}" is the layer number
    shape: tuple  # global shape per layer (layer rows) or of the tensor; -1 = "at least vocab rows"
    kind: str = "copy"  # copy | qkv | glu | vocab
    per_layer: bool = False
    meta: dict = field(default_factory=dict)

    @property
    def param(self) -> str:
        """The parameter's module path in a TP=1 model on the local (torch) layer spec, "{i}" = layer:
        the key without the layer axis, and the layer norms under their module names."""
        if not self.per_layer:
            return self.key
        suffix = self.key[len(LAYERS):]
        for fused, module in (("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
                              ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm.")):
            if suffix.startswith(fused):
                suffix = module + suffix[len(fused):]
        return f"{LAYERS}{{i}}.{suffix}"


def weight_rows(model: ModelConfig, feedback: FeedbackConfig) -> list[Row]:
    """Every tensor of a checkpoint of this config, in export order (non-layer tensors around the layers)."""
    g = lambda name, default: getattr(model, name, default)  # noqa: E731
    d, heads = model.hidden_size, model.num_attention_heads
    hd = d // heads
    groups = g("num_query_groups", None) or heads
    ffn = model.ffn_hidden_size or 4 * d
    gated = g("activation", "gelu") == "swiglu"
    bias = g("add_bias_linear", True)
    qkv_bias = bias or g("add_qkv_bias", False)
    layer_norm = model.normalization == "LayerNorm"
    qkv_rows = (heads + 2 * groups) * hd
    qkv_meta = {"heads": heads, "groups": groups, "head_dim": hd}
    vocab = {"vocab": model.vocab_size}

    rows = [Row("gpt.embedding.word_embeddings.weight", ("model.embed_tokens.weight",), (-1, d), "vocab", meta=vocab)]
    if model.position_embedding_type == "learned_absolute":
        rows.append(Row("gpt.embedding.position_embeddings.weight", ("model.embed_positions.weight",),
                        (model.max_sequence_length, d)))

    def layer(key, hf, shape, kind="copy", meta=None):
        rows.append(Row(LAYERS + key, tuple(f"model.layers.{{i}}.{h}" for h in hf), shape, kind, True, meta or {}))

    def norm(key, hf):
        layer(f"{key}.layer_norm_weight", [f"{hf}.weight"], (d,))
        if layer_norm:
            layer(f"{key}.layer_norm_bias", [f"{hf}.bias"], (d,))

    qkv_names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    norm("self_attention.linear_qkv", "input_layernorm")
    layer("self_attention.linear_qkv.weight", [f"{n}.weight" for n in qkv_names], (qkv_rows, d), "qkv", qkv_meta)
    if qkv_bias:
        layer("self_attention.linear_qkv.bias", [f"{n}.bias" for n in qkv_names], (qkv_rows,), "qkv", qkv_meta)
    layer("self_attention.linear_proj.weight", ["self_attn.o_proj.weight"], (d, heads * hd))
    if bias:
        layer("self_attention.linear_proj.bias", ["self_attn.o_proj.bias"], (d,))
    norm("mlp.linear_fc1", "post_attention_layernorm")
    fc1 = ["mlp.gate_proj", "mlp.up_proj"] if gated else ["mlp.up_proj"]
    layer("mlp.linear_fc1.weight", [f"{n}.weight" for n in fc1], ((2 if gated else 1) * ffn, d),
          "glu" if gated else "copy")
    if bias:
        layer("mlp.linear_fc1.bias", [f"{n}.bias" for n in fc1], ((2 if gated else 1) * ffn,),
              "glu" if gated else "copy")
    layer("mlp.linear_fc2.weight", ["mlp.down_proj.weight"], (d, ffn))
    if bias:
        layer("mlp.linear_fc2.bias", ["mlp.down_proj.bias"], (d,))

    rows.append(Row("gpt.decoder.final_layernorm.weight", ("model.norm.weight",), (d,)))
    if layer_norm:
        rows.append(Row("gpt.decoder.final_layernorm.bias", ("model.norm.bias",), (d,)))
    if not model.tie_embeddings:
        rows.append(Row("gpt.output_layer.weight", ("lm_head.weight",), (-1, d), "vocab", meta=vocab))
    if feedback.fusion != "off":
        for ours, theirs in (("value", "value_proj"), ("gate", "gate_proj")):
            rows.append(Row(f"feedback.{ours}.weight", (f"feedback.{theirs}.weight",), (d, d)))
            if feedback.bias:
                rows.append(Row(f"feedback.{ours}.bias", (f"feedback.{theirs}.bias",), (d,)))
        rows.append(Row("feedback.initial_state", ("feedback.initial_state",), (d,)))
    return rows


def global_shape(row: Row, num_layers: int) -> tuple:
    return ((num_layers,) if row.per_layer else ()) + row.shape


def shape_matches(row: Row, stored: tuple, num_layers: int) -> bool:
    want = global_shape(row, num_layers)
    if len(want) != len(stored):
        return False
    return all(w == s or (w == -1 and s >= row.meta.get("vocab", 0)) for w, s in zip(want, stored))


# ---------------------------------------------------------------------- transforms
def to_hf(row: Row, tensor: torch.Tensor) -> list[torch.Tensor]:
    """One checkpoint tensor (one layer's slice for layer rows) -> the HF tensors of ``row.hf``."""
    if row.kind == "copy":
        return [tensor]
    if row.kind == "vocab":
        return [tensor[: row.meta["vocab"]]]
    if row.kind == "glu":
        return list(tensor.chunk(2, dim=0))
    if row.kind == "qkv":
        m = row.meta
        per_group = m["heads"] // m["groups"]
        grouped = tensor.reshape(m["groups"], per_group + 2, m["head_dim"], *tensor.shape[1:])
        q, k, v = grouped[:, :per_group], grouped[:, per_group], grouped[:, per_group + 1]
        return [t.reshape(-1, *tensor.shape[1:]) for t in (q, k, v)]
    raise ValueError(f"unknown row kind {row.kind!r}")


def from_hf(row: Row, tensors: list[torch.Tensor], padded_vocab: int | None = None) -> torch.Tensor:
    """The inverse of :func:`to_hf`: HF tensors -> the checkpoint tensor (one layer's slice)."""
    if row.kind == "copy":
        return tensors[0]
    if row.kind == "vocab":
        t = tensors[0]
        if padded_vocab and padded_vocab > t.shape[0]:
            t = torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])
        return t
    if row.kind == "glu":
        return torch.cat(tensors, dim=0)
    if row.kind == "qkv":
        m = row.meta
        per_group = m["heads"] // m["groups"]
        q, k, v = tensors
        rest = q.shape[1:]
        q = q.reshape(m["groups"], per_group, m["head_dim"], *rest)
        k = k.reshape(m["groups"], 1, m["head_dim"], *rest)
        v = v.reshape(m["groups"], 1, m["head_dim"], *rest)
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)
    raise ValueError(f"unknown row kind {row.kind!r}")


def hf_names(row: Row, layer: int | None = None) -> list[str]:
    return [n.format(i=layer) for n in row.hf]
