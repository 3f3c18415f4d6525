"""The stock Hugging Face model families `fbt convert from-hf` imports and `to-hf --standard` writes back.

Each family is the Llama block under another ``model_type``; what it implies beyond Llama's config
fields is stated here, so :mod:`mapping` reads one vocabulary of fields:
- ``llama`` (Llama 2, 3.x with ``rope_type: llama3``, tied embeddings as Llama 3.2 1B/3B);
- ``mistral``: the Llama architecture; a sliding window shorter than the context is refused (our
  attention is full causal, so the model would change);
- ``qwen2`` (Qwen2, Qwen2.5): biases on q/k/v only (Megatron's ``add_qkv_bias``), none on o_proj or
  the MLP; sliding-window layers are refused.

A field that would change the model and that the block cannot hold (another head_dim, partial rotary,
sliding windows) is refused by name, before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fbt_megatron.hf.mapping import ConversionError


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # transformers' class for the standard model
    implied: dict = field(default_factory=dict)  # fields the family's modelling code fixes
    standard_fields: dict = field(default_factory=dict)  # written into a --standard config


FAMILIES = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM"),
    Family("mistral", "MistralForCausalLM", standard_fields={"sliding_window": None}),
    Family("qwen2", "Qwen2ForCausalLM", implied={"qkv_bias": True, "attention_bias": False, "mlp_bias": False},
           standard_fields={"use_sliding_window": False, "sliding_window": None}),
)}


def _refuse_sliding_window(cfg: dict, where: str) -> None:
    window = cfg.get("sliding_window")
    context = cfg.get("max_position_embeddings")
    used = cfg.get("use_sliding_window", True)  # Qwen2 switches it; Mistral uses it whenever it is set
    if used and window is not None and (context is None or window < context):
        raise ConversionError(f"{where}: sliding_window={window} (max_position_embeddings={context}): windowed "
                              "attention has no fbt_megatron equivalent (full causal attention), so the model "
                              "would change; allowed: sliding_window null or >= max_position_embeddings")
    layers = [t for t in cfg.get("layer_types") or [] if t != "full_attention"]
    if layers:
        raise ConversionError(f"{where}: layer_types lists {sorted(set(layers))}: only 'full_attention' converts")


def normalise(cfg: dict, where: str) -> dict:
    """A stock family's config dict as Llama-vocabulary fields (the family's implied ones added); refuses
    what the Megatron block cannot compute, naming the field."""
    family = FAMILIES[cfg["model_type"]]
    _refuse_sliding_window(cfg, where)
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim * cfg["num_attention_heads"] != cfg["hidden_size"]:
        raise ConversionError(f"{where}: head_dim={head_dim} differs from hidden_size / num_attention_heads = "
                              f"{cfg['hidden_size'] // cfg['num_attention_heads']}; allowed: equal")
    for key in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(key)
        if isinstance(rope, dict) and rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConversionError(f"{where}: {key}.partial_rotary_factor={rope['partial_rotary_factor']}: only "
                                  "full rotary converts; allowed: 1.0")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConversionError(f"{where}: partial_rotary_factor={cfg['partial_rotary_factor']}: allowed: 1.0")
    return {**cfg, **family.implied}


def standard_family(model, source: str | None) -> Family:
    """The family a --standard export is written as: Qwen2 for q/k/v-only biases, else the imported
    source's family (Mistral comes back as Mistral), else Llama."""
    if getattr(model, "add_qkv_bias", False) and not model.add_bias_linear:
        return FAMILIES["qwen2"]
    family = FAMILIES.get(source or "llama", FAMILIES["llama"])
    return FAMILIES["llama"] if family.implied else family
