"""Typed configuration of the FBT model and its feedback schedule.

These are the recipe's ``model``, ``feedback`` and ``schedule`` sections. They are pydantic models
with unknown keys forbidden, so a bad value fails at construction with the field's name and the
allowed values, before any process group starts.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

FUSION_MODES = ("glu", "additive", "off")
GRAD_MODES = ("all", "last")
# What a pass feeds where no previous state exists (pass 1 everywhere; position 0 and document
# starts in later passes): "embedding" = the token embedding e_t, so pass 1 is exactly a standard GPT
# (the paper's reading, the default); "state" = fuse(h_init, e_t) (an ablation).
FIRST_INPUTS = ("embedding", "state")
# A checkpoint or HF export written before ``first_input`` existed was trained with this rule.
LEGACY_FIRST_INPUT = "state"


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class RopeScaling(StrictModel):
    """Llama 3.x's frequency-dependent RoPE scaling: transformers' ``rope_type: llama3`` and Megatron-Core's
    ``RotaryEmbedding._apply_scaling`` (the same formula), with its four parameters, so an imported Llama
    3.x keeps its positions (Llama 3.2: factor 32, low 1, high 4, original 8192)."""

    factor: float = Field(8.0, gt=0.0, description="How far the long wavelengths are stretched.")
    low_freq_factor: float = Field(1.0, gt=0.0, description="Wavelengths past original / this are scaled fully.")
    high_freq_factor: float = Field(4.0, gt=0.0, description="Wavelengths under original / this are kept.")
    original_max_position_embeddings: int = Field(8192, ge=1, description="The context the model was trained at.")

    @model_validator(mode="after")
    def _factors_ordered(self):
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"model.rope_scaling.high_freq_factor={self.high_freq_factor} must exceed "
                             f"low_freq_factor={self.low_freq_factor} (the smoothing divides by their difference)")
        return self


class ModelConfig(StrictModel):
    """Transformer size and architecture (Megatron-Core GPT).

    The defaults are a GPT-2-style block (GELU MLP, LayerNorm, biases, tied embeddings). A Llama-class
    model sets ``activation: swiglu``, ``normalization: RMSNorm``, ``num_query_groups`` (grouped-query
    attention), ``add_bias_linear: false``, ``tie_embeddings: false`` and ``rotary_base``
    (recipes/1b.yaml, recipes/fbt-*.yaml and docs/architecture.md).
    """

    num_layers: int = Field(4, ge=1, description="Transformer layers in the stack.")
    hidden_size: int = Field(128, ge=1, description="Width of the residual stream.")
    num_attention_heads: int = Field(4, ge=1, description="Attention heads; must divide hidden_size.")
    num_query_groups: int | None = Field(
        None, ge=1, description="Grouped-query attention: key/value heads shared by the query heads (None: one per "
        "head; 1: multi-query). Must divide num_attention_heads.")
    ffn_hidden_size: int | None = Field(
        None, ge=1, description="MLP width (None: 4 x hidden_size; Llama-style SwiGLU uses about 8/3 x hidden_size).")
    activation: Literal["gelu", "swiglu"] = Field(
        "gelu", description="gelu: fc2(gelu(fc1 x)); swiglu: fc2(silu(x W_gate) * (x W_up)), Megatron's gated unit.")
    add_bias_linear: bool = Field(True, description="Biases in every linear layer of the stack (Llama: false).")
    add_qkv_bias: bool = Field(False, description="Biases on the query/key/value projection only (Qwen2).")
    vocab_size: int = Field(
        4096, ge=2, description="The tokenizer's vocabulary. Embedding and LM head are padded to a multiple of "
        "vocab_pad_multiple x TP rows; padded logits are never predicted.")
    vocab_pad_multiple: int = Field(128, ge=1, description="Pad the vocabulary rows to a multiple of this times TP.")
    max_sequence_length: int = Field(256, ge=2, description="Longest sequence the positions cover.")
    position_embedding_type: Literal["rope", "learned_absolute"] = Field(
        "rope", description="Rotary position embeddings, or learned absolute positions.")
    rotary_base: int = Field(10000, ge=1, description="RoPE theta (Llama 2: 10000, Llama 3: 500000).")
    rope_scaling: RopeScaling | None = Field(None, description="Llama 3.x's scaled RoPE (None: plain RoPE).")
    normalization: Literal["LayerNorm", "RMSNorm"] = Field("LayerNorm", description="The norm of every block.")
    norm_epsilon: float = Field(1e-5, gt=0.0, description="Epsilon of the norms.")
    hidden_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the residual branches.")
    attention_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the attention probabilities.")
    attention_mask: Literal["document_causal", "causal"] = Field(
        "document_causal", description="Packed rows: document_causal lets each document attend only to itself "
        "(positions restart per document); causal spans the whole row.")
    init_method_std: float = Field(0.02, gt=0.0, description="Standard deviation of the normal weight init.")
    tie_embeddings: bool = Field(
        True, description="Input embedding == output layer, so the fed-back state and the embeddings share a space.")
    recompute: Literal["none", "selective", "full"] = Field(
        "none", description="Activation recomputation in every pass: selective recomputes core attention; full "
        "keeps only each layer's input.")

    @model_validator(mode="after")
    def _heads_divide_hidden(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} must be divisible by "
                f"model.num_attention_heads={self.num_attention_heads}"
            )
        groups = self.num_query_groups
        if groups is not None and (groups > self.num_attention_heads or self.num_attention_heads % groups):
            raise ValueError(
                f"model.num_query_groups={groups} must divide model.num_attention_heads="
                f"{self.num_attention_heads}; allowed: "
                f"{[g for g in range(1, self.num_attention_heads + 1) if self.num_attention_heads % g == 0]}"
            )
        return self

    @model_validator(mode="after")
    def _scaling_needs_rope(self):
        if self.rope_scaling is not None and self.position_embedding_type != "rope":
            raise ValueError(f"model.rope_scaling applies to position_embedding_type='rope' only (got "
                             f"{self.position_embedding_type!r}); remove it")
        return self

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Rows of the embedding / LM head: vocab_size rounded up to a multiple of vocab_pad_multiple x TP."""
        multiple = self.vocab_pad_multiple * tp
        return -(-self.vocab_size // multiple) * multiple

    def check_tensor_parallel(self, tp: int) -> None:
        """Sizes that tensor parallelism shards must divide by TP; say which one does not."""
        for name in ("hidden_size", "num_attention_heads", "num_query_groups"):
            value = getattr(self, name)
            if value is not None and value % tp:
                raise ValueError(
                    f"model.{name}={value} is not divisible by tensor parallel size {tp}; "
                    f"allowed: multiples of {tp}"
                )
        if self.ffn_size % tp:
            raise ValueError(f"model.ffn_hidden_size={self.ffn_size} is not divisible by tensor parallel size {tp}")


class FeedbackConfig(StrictModel):
    """Latent feedback: how the previous top-layer state is fused with the token embedding.

    ``fusion``: ``glu`` x = (W_U h) * sigmoid(W_G e) (the paper's; the state is the value path, the
    token only gates it), ``additive`` x = W_U h + W_G e (the symmetric fusion the paper argues
    against, for ablation), ``off`` x = e (a standard GPT; no fusion weights exist).
    """

    fusion: str = Field(
        "glu", description="glu: x = (W_U h) * sigmoid(W_G e), the paper's; additive: x = W_U h + W_G e (ablation); "
        "off: x = e, a standard GPT with no fusion weights.", json_schema_extra={"allowed": list(FUSION_MODES)})
    bias: bool = Field(False, description="Biases on the fusion's W_U and W_G.")
    first_input: Literal["embedding", "state"] = Field(
        "embedding", description="What the stack reads where no previous state exists (pass 1, position 0, document "
        "starts): embedding e_t, so pass 1 is the ordinary transformer; or state fuse(h_init, e_t), an ablation.")
    value_init: Literal["normal", "identity"] = Field(
        "identity", description="W_U init: normal N(0, init_method_std), depth-scaled; or identity, "
        "value_init_scale x I, so a state is read like the embedding of the token it predicts (tied).")
    value_init_scale: float | None = Field(
        None, gt=0.0, description="Scale of the identity W_U (None: 2 x init_method_std, the embeddings' scale).")
    gate_init: Literal["normal", "unit_spread"] = Field(
        "unit_spread", description="W_G init: normal N(0, init_method_std) gives a gate near 1/2 for every token; "
        "unit_spread gives W_G e unit spread, so the gate carries the token.")
    prefix_mixin: float = Field(
        0.1, ge=0.0, le=1.0, description="Stabiliser: the fed-back h becomes (1-a) h + a h_init.")
    mixin: Literal["affine", "bounded"] = Field(
        "affine", description="affine: W_U((1-a) h + a h_init), which W_U can undo; bounded: W_U divided by "
        "max(1, its spectral norm), so the fusion contracts by 1 - a.")
    depth_scaling: bool = Field(True, description="Initialise W_U with std / sqrt(2 x num_layers).")
    jitter_std: float = Field(0.02, ge=0.0, description="Gaussian noise on the fed-back state, in training only.")
    grad_mode: str = Field(
        "all", description="all: backpropagate through every pass; last: earlier passes run without gradient.",
        json_schema_extra={"allowed": list(GRAD_MODES)})
    loss_on: Literal["last", "mean"] = Field(
        "last", description="The loss of the last pass, or the mean over the passes.")

    @field_validator("fusion", mode="before")
    @classmethod
    def _fusion(cls, v):
        if v is False:  # YAML 1.1 reads a bare `off` (in a recipe or a `feedback.fusion=off` override) as false
            v = "off"
        if v not in FUSION_MODES:
            raise ValueError(f"feedback.fusion={v!r} is not one of {FUSION_MODES}")
        return v

    @field_validator("grad_mode")
    @classmethod
    def _grad_mode(cls, v):
        if v not in GRAD_MODES:
            raise ValueError(f"feedback.grad_mode={v!r} is not one of {GRAD_MODES}")
        return v

    @property
    def fused_first_pass(self) -> bool:
        """The ``state`` ablation: the fusion (of h_init) feeds pass 1 too."""
        return self.fusion != "off" and self.first_input == "state"

    @model_validator(mode="after")
    def _init_options_that_apply(self):
        if self.value_init_scale is not None and self.value_init != "identity":
            raise ValueError(f"feedback.value_init_scale={self.value_init_scale} applies to value_init='identity' only "
                             f"(value_init={self.value_init!r} draws W_U from N(0, init_method_std), depth-scaled "
                             "with depth_scaling); remove it or set value_init: identity")
        return self

    @model_validator(mode="after")
    def _loss_reachable_by_gradient(self):
        # grad_mode="last" runs passes 1..k-1 without gradient, so a mean over passes would report
        # the mean but backpropagate only (1/k) * grad of the last pass's loss.
        if self.grad_mode == "last" and self.loss_on == "mean":
            raise ValueError("feedback.loss_on='mean' needs feedback.grad_mode='all' (with grad_mode='last' the "
                             "earlier passes carry no gradient); use loss_on='last' or grad_mode='all'")
        return self


class PassScheduleConfig(StrictModel):
    """Passes per global batch: 1 until ``feedback_start_step``, then drawn from ``mix``; always 1 without a fusion (``feedback.fusion: off``).

    ``mix[i]`` is the probability of i+1 passes (default 75% 1-pass, 22% 2-pass, 3% 3-pass).
    ``seed`` keys the draws; a recipe that does not set it uses the recipe's ``seed`` (a checkpoint
    written before that keeps the seed it was trained with: :meth:`PassSchedule.load_state_dict`).
    """

    feedback_start_step: int = Field(0, ge=0, description="Optimiser step of the switch to multi-pass batches.")
    mix: list[float] = Field(
        default_factory=lambda: [0.75, 0.22, 0.03],
        description="After the switch, mix[i] is the probability of i+1 passes; sums to 1.")
    seed: int = Field(0, ge=0, description="Keys the pass-count draws (unset: the recipe's seed).",
                      json_schema_extra={"default_shown": "the recipe's `seed`"})
    # True when ``seed`` was taken from the recipe's seed rather than set (Recipe's validator).
    _seed_follows_recipe: bool = PrivateAttr(False)

    @field_validator("mix")
    @classmethod
    def _mix(cls, v):
        if not v:
            raise ValueError("schedule.mix must list at least one probability (for k=1)")
        if any(p < 0 for p in v):
            raise ValueError(f"schedule.mix={v} has a negative probability; allowed: values in [0, 1]")
        if abs(sum(v) - 1.0) > 1e-6:
            raise ValueError(f"schedule.mix={v} sums to {sum(v):.6g}; it must sum to 1")
        return v


def saved_feedback_section(section: dict | None) -> dict:
    """A checkpoint's (or export's) saved ``feedback`` section, read with the rule it was trained
    under: one written before ``first_input`` existed used the ``state`` rule."""
    section = dict(section or {})
    section.setdefault("first_input", LEGACY_FIRST_INPUT)
    section.setdefault("mixin", "affine")  # the only form before ``mixin`` existed
    return section


def check_num_passes(k: int) -> int:
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"num_passes={k!r} is invalid; allowed: an integer >= 1")
    return k


class SyntheticDataConfig(BaseModel):
    """The recipe's ``data.synthetic`` section (the generator is :mod:`fbt_megatron.data.synthetic`).

    ``task``: ``affine`` (documents following random affine recurrences, next-token labels) or
    ``state_tracking`` (one row a problem: a sequence of elements of a finite group, labelled at each
    position with their running product; ``group``: ``cyclic`` (a running sum mod ``group_size``) or
    ``symmetric`` (composing permutations of ``group_size`` items)).
    """

    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(256, ge=4, description="Tokens the generator draws from.")
    seq_length: int = Field(64, ge=2, description="Tokens per row (the recipe's data.seq_length sets it).")
    seed: int = Field(0, ge=0, description="Seed of the generated data.")
    mean_doc_length: int = Field(48, ge=2, description="Mean document length of the affine task.")
    noise: float = Field(0.05, ge=0.0, le=1.0, description="Share of tokens replaced at random (affine task).")
    task: Literal["affine", "state_tracking"] = Field(
        "affine", description="affine: documents following random affine recurrences; state_tracking: running "
        "products in a finite group, one element per token.")
    group: Literal["cyclic", "symmetric"] = Field(
        "cyclic", description="state_tracking: cyclic (a running sum mod group_size) or symmetric (permutations).")
    group_size: int = Field(5, ge=2, description="state_tracking: the group's size parameter.")

    @model_validator(mode="after")
    def _group_fits_vocabulary(self):
        if self.task == "state_tracking":
            order = self.group_order
            if order > self.vocab_size:
                raise ValueError(f"data.synthetic: the {self.group} group of size {self.group_size} has {order} "
                                 f"elements, more than vocab_size={self.vocab_size}")
        return self

    @property
    def group_order(self) -> int:
        """Elements of the state-tracking group (its tokens are 0..order-1)."""
        return self.group_size if self.group == "cyclic" else math.factorial(self.group_size)
