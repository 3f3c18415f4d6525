"""The full-bandwidth GPT: Megatron-Core's GPTModel with latent feedback at the stack's input,
trained by multi-pass teacher forcing.

Multi-pass teacher forcing is Jacobi iteration of the recurrence along the sequence (the rule for
each pass's input is :meth:`LatentFeedback.pass_input`, in ``feedback.py``):
- pass 1: the token embeddings, an ordinary GPT forward (the initial guess of the states);
- pass k > 1: pass k-1's top states are shifted one position right (position t receives h_{t-1}) and
  fused with the token embeddings; positions that start a document read their embedding (no state
  exists there); the whole stack re-runs in parallel.
After k passes positions < k (counted from their document's start) equal the token-by-token
recurrence (``sequential.py``, written from the formulas); tests check this rather than assume it.

Gradient modes: ``all`` backpropagates through every pass; ``last`` runs passes 1..k-1 without
gradient (their states enter the last pass as constants), as Huginn does. The loss is the last
pass's (``loss_on="last"``) or, in training, the mean over passes (``"mean"``); in eval mode a k-pass
loss is always the last pass's, the prediction a k-pass read-out makes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import get_num_layers_to_build

from fbt_megatron import runtime
from fbt_megatron.config import FeedbackConfig, ModelConfig, check_num_passes
from fbt_megatron.model import feedback_rule as rule
from fbt_megatron.model import cpu_fastpaths, vocab
from fbt_megatron.model.attention import (PACKED_BACKENDS, PackedSeqParams, adapt_layer_spec, document_causal_mask,
                                          document_positions, documents_seq_params, from_packed,
                                          installed_te_version, packed_rotary_length, packed_seq_params,
                                          rotary_for_positions, spec_backend, to_packed)
from fbt_megatron.model.feedback import LatentFeedback
from fbt_megatron.model.kernels import fused_switches
from fbt_megatron.model.recompute import recompute_layers


@dataclass
class FBTOutput:
    token_loss: torch.Tensor | None = None  # [B, S] per-token cross entropy (labels given)
    logits: torch.Tensor | None = None  # [B, S, V/TP] (labels not given)
    hidden: torch.Tensor | None = None  # [S, B, D] top state of the last pass (full sequence)
    # ||h^k - h^{k-1}|| / ||h^{k-1}|| for k = 2..passes: the Jacobi residual, a stability signal.
    pass_residuals: list[torch.Tensor] = field(default_factory=list)


def reset_positions(doc_start, batch: int, seq_len: int, device) -> torch.Tensor:
    """[S, B] bool: positions with no previous state in their document — position 0 and every
    document start (they read their embedding; under the state rule, fuse(h_init, e))."""
    return rule.reset_positions(None if doc_start is None else doc_start.t(), (seq_len, batch), 0, device)


RECOMPUTE = {  # ModelConfig.recompute -> Megatron's TransformerConfig switches
    "none": {},
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    "full": {},  # FBT's own non-reentrant per-layer recompute (recompute.py), installed on the layers
}


def transformer_config(model: ModelConfig, *, sequence_parallel: bool = False,
                       dtype: torch.dtype | None = None) -> TransformerConfig:
    """Megatron TransformerConfig for the current parallel state; fused kernels only where installed.
    ``dtype`` defaults to the device's (bf16 on GPU, fp32 on CPU)."""
    model.check_tensor_parallel(parallel_state.get_tensor_model_parallel_world_size())
    on_gpu = runtime.use_cuda()
    if dtype is None:
        dtype = torch.bfloat16 if runtime.default_dtype_name() == "bf16" else torch.float32
    swiglu = model.activation == "swiglu"
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_size,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        init_method_std=model.init_method_std,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        **RECOMPUTE[model.recompute],
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=dtype,  # what travels between stages
        sequence_parallel=sequence_parallel,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not on_gpu,
        perform_initialization=True,
        **fused_switches(model.normalization, on_gpu, activation=model.activation, bf16=dtype == torch.bfloat16),
    )


def layer_spec(model: ModelConfig):
    """Transformer-Engine layers when importable on GPU, Megatron's local (torch) layers otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if runtime.use_cuda():
        try:
            import transformer_engine  # noqa: F401

            return specs.get_gpt_layer_with_transformer_engine_spec()
        except ImportError:
            pass
    return specs.get_gpt_layer_local_spec(normalization=model.normalization)


def _seeded_layer_spec(spec, base_seed: int):
    """``spec`` whose layers draw their (CPU) initial weights from a generator seeded by the layer's
    *global* number: a pipeline stage that builds only layers 5..8 gets the same values as the
    whole model does, so PP=1 and PP=2 start from identical weights."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layer_cls = spec.module

    class SeededLayer(layer_cls):
        def __init__(self, config, submodules, layer_number: int = 1, **kwargs):
            offset = get_transformer_layer_offset(config, kwargs.get("vp_stage"))
            torch.default_generator.manual_seed(base_seed + layer_number + offset)
            super().__init__(config, submodules, layer_number=layer_number, **kwargs)

    SeededLayer.__name__ = SeededLayer.__qualname__ = layer_cls.__name__
    return replace(spec, module=SeededLayer)


def _seeded_spec(spec, base_seed: int):
    """:func:`_seeded_layer_spec` for a layer spec or for block submodules (local layers with
    ``norms.TorchNorm``, see ``adapt_layer_spec``)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if isinstance(spec, TransformerBlockSubmodules):
        seeded = {id(s): _seeded_layer_spec(s, base_seed) for s in spec.layer_specs}
        return replace(spec, layer_specs=[seeded[id(s)] for s in spec.layer_specs])
    return _seeded_layer_spec(spec, base_seed)


def scale_rotary(rotary, scaling) -> None:
    """Llama 3.x's RoPE scaling on Megatron's rotary embedding, by Megatron's own formula with all four
    parameters (GPTModel passes only the factor, the others at Llama 3's values)."""
    rotary.inv_freq = rotary._apply_scaling(
        rotary.inv_freq, factor=scaling.factor, low_freq_factor=scaling.low_freq_factor,
        high_freq_factor=scaling.high_freq_factor,
        original_max_position_embeddings=scaling.original_max_position_embeddings)


class FBTGPTModel(MegatronModule):
    """The whole model, or under pipeline parallelism one stage of it: a slice of the layers
    (Megatron's layer offsets, so checkpoint keys carry global layer numbers), the embedding, the
    fusion weights and h_init on the first stage, final norm and LM head on the last. A stage is
    driven by :mod:`fbt_megatron.parallel.pipeline_runner`; ``forward`` runs the whole model only.
    ``spec`` overrides the layer spec (generation passes Megatron's local layers). ``packed``: feed
    packed sequences (THD, ``cu_seqlens`` from ``doc_start``) instead of a dense document mask; by
    default when the layers are Transformer Engine's (``attention.py``); on Megatron's local layers it
    is the per-document emulation of that path."""

    def __init__(self, model: ModelConfig, feedback: FeedbackConfig, config: TransformerConfig, spec=None,
                 init_seed: int = 0, packed: bool | None = None):
        super().__init__(config)
        self.model_config, self.feedback_config = model, feedback
        self.pipelined = config.pipeline_model_parallel_size > 1
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        self.padded_vocab_size = model.padded_vocab_size(config.tensor_model_parallel_size)
        # TP-invariant initialisation (Megatron's CPU init): the padded vocabulary depends on TP, so the
        # embedding draws its logical rows only, and the untied LM head (built last) is re-drawn below.
        config.embedding_init_method = vocab.logical_rows_init(
            model.vocab_size, self.padded_vocab_size, config.embedding_init_method_std or config.init_method_std)
        rng_before = torch.get_rng_state()
        spec = spec if spec is not None else layer_spec(model)
        self.attention_backend = spec_backend(spec, model.attention_mask, config.params_dtype)
        if packed is None:
            packed = self.attention_backend in PACKED_BACKENDS
        elif packed and (model.attention_mask != "document_causal" or self.attention_backend == "unfused"):
            raise ValueError("packed sequences need model.attention_mask: document_causal and, on Transformer "
                             "Engine's layers, bf16/fp16 or Transformer Engine >= 2.11 (before it TE has no fp32 "
                             f"backend for packed sequences) (got {model.attention_mask}, {config.params_dtype}, "
                             f"Transformer Engine {installed_te_version()})")
        self.packed = packed
        if packed and self.attention_backend == "sdpa":
            self.attention_backend = "packed-emulation"  # local layers: each document attended alone
        elif not packed and self.attention_backend in PACKED_BACKENDS:
            self.attention_backend = "unfused"  # TE layers asked for the dense mask
        # TE's fused THD RoPE: positions restart at every packed sequence from the plain table, on device
        # (Megatron's unfused THD RoPE splits by .tolist() and reads offsets with .item(): host syncs).
        config.apply_rope_fusion = self.attention_backend in PACKED_BACKENDS
        spec = adapt_layer_spec(spec, model.attention_mask, get_num_layers_to_build(config),
                                packed=packed)  # this stage's layers
        cpu_fastpaths.install(runtime.device())  # a no-op off the CPU (model/cpu_fastpaths.py)
        with runtime.cuda_calls_stay_on_cpu():  # megatron moves the tied last-stage copy with .cuda()
            self.gpt = GPTModel(
                config=config,
                transformer_layer_spec=_seeded_spec(spec, init_seed),
                vocab_size=self.padded_vocab_size,
                max_sequence_length=model.max_sequence_length,
                position_embedding_type=model.position_embedding_type,
                rotary_base=model.rotary_base,
                share_embeddings_and_output_weights=model.tie_embeddings,
                pre_process=first,
                post_process=last,
            )
        if model.rope_scaling is not None and model.position_embedding_type == "rope":
            scale_rotary(self.gpt.rotary_pos_emb, model.rope_scaling)
        if config.use_cpu_initialization and last and not model.tie_embeddings:
            head_seed = int(torch.randint(2**62, (1,), generator=torch.Generator().set_state(rng_before)))
            vocab.reinit_logical_rows(self.gpt.output_layer.weight, model.vocab_size, config.init_method_std, head_seed)
        if model.recompute == "full":
            recompute_layers(self.gpt.decoder.layers)
        torch.default_generator.manual_seed(init_seed)  # the fusion's init, whatever layers came before
        self.feedback = LatentFeedback(config, feedback) if feedback.fusion != "off" and first else None
        self._mask_cache: dict[tuple, torch.Tensor] = {}
        # This rank's LM-head columns that are vocabulary padding (None when it holds none): a tail of its
        # columns, filled from _padding_start on (an int: no mask to copy to the device per head call).
        self._padding_columns = vocab.local_padding_mask(model.vocab_size, self.padded_vocab_size)
        self._padding_start = None if self._padding_columns is None else int(self._padding_columns.int().argmax())

    # ----------------------------------------------------------------- helpers
    def causal_mask(self, seq_len: int, device) -> torch.Tensor:
        key = (seq_len, str(device))
        if key not in self._mask_cache:  # True = masked out, as Megatron expects
            self._mask_cache[key] = torch.triu(
                torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1
            )[None, None]
        return self._mask_cache[key]

    def attention_inputs(self, reset: torch.Tensor, position_ids=None, cu_seqlens=None, max_seqlen=None):
        """Mask [.., S, S] and positions [B, S] for a packed row with document starts ``reset`` [S, B]
        (see ``attention.py``); explicit ``position_ids`` override the derived positions. ``cu_seqlens``,
        ``max_seqlen``: the loader's packed documents of the same rows (the packed path then reads no
        value back from the device)."""
        seq_len, batch = reset.shape
        if self.packed:  # no mask: PackedSeqParams, which run_stack recognises
            mask = packed_seq_params(reset) if cu_seqlens is None else \
                documents_seq_params(cu_seqlens, max_seqlen, reset.device)
            positions = document_positions(reset)
        elif self.model_config.attention_mask == "document_causal":
            mask, positions = document_causal_mask(reset), document_positions(reset)
        else:
            mask = self.causal_mask(seq_len, reset.device)
            positions = torch.arange(seq_len, device=reset.device).expand(batch, -1)
        return mask, (positions if position_ids is None else position_ids)

    def _full_sequence(self, t: torch.Tensor) -> torch.Tensor:
        if self.config.sequence_parallel:  # grads downstream are TP-replicated: split, not reduce
            return tensor_parallel.gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=False)
        return t

    def run_stack(self, stack_input, mask, rotary) -> torch.Tensor:
        """One pass through this stage's transformer layers (the final layernorm on the last stage).
        ``mask`` is a dense mask, or PackedSeqParams (packed sequences: the [S, B, D] input runs as the
        rows end to end, [B*S, 1, D], and comes back as [S, B, D])."""
        packed = mask if isinstance(mask, PackedSeqParams) else None
        x = stack_input if packed is None else to_packed(stack_input)
        if not self.gpt.pre_process:  # megatron's later stages read their input from set_input_tensor
            self.gpt.decoder.set_input_tensor(x)
        if packed is None:
            return self.gpt.decoder(hidden_states=x, attention_mask=mask, rotary_pos_emb=rotary)
        out = self.gpt.decoder(hidden_states=x, attention_mask=None, rotary_pos_emb=rotary, packed_seq_params=packed)
        return from_packed(out, stack_input.shape[1])

    def embed(self, input_ids, position_ids, word_weight=None) -> torch.Tensor:
        """Token (+ position) embeddings [S, B, D]; ``word_weight`` stands in for the word-embedding
        weight (the pipeline passes a detached copy of a weight tied across stages)."""
        if word_weight is None:
            return self.gpt.embedding(input_ids=input_ids, position_ids=position_ids)
        return torch.func.functional_call(self.gpt.embedding, {"word_embeddings.weight": word_weight},
                                          (input_ids, position_ids))

    def head(self, top_state, labels=None, weight=None):
        """LM head on the top state: per-token loss [B, S] if labels, else logits [B, S, V_pad/TP]
        (padded vocabulary columns are -inf: they take no probability, in the loss or in sampling).
        ``weight`` stands in for the tied output weight (see :meth:`embed`)."""
        if weight is None and self.gpt.share_embeddings_and_output_weights:
            weight = self.gpt.shared_embedding_or_output_weight()
        logits, _ = self.gpt.output_layer(top_state, weight=weight)
        if self._padding_start is not None:  # in place: the padded tail of this rank's columns
            logits[..., self._padding_start:].fill_(float("-inf"))
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.language_model_loss(labels, logits)

    def language_model_loss(self, labels, logits):
        """Per-token cross entropy [B, S] of the head's logits [S, B, V_pad/TP] against ``labels`` [B, S]:
        on GPU Megatron's ``GPTModel.compute_language_model_loss`` with its fused loss (TE's, which keeps no
        fp32 copy of the logits: ``kernels.cross_entropy_switches``); otherwise
        ``tensor_parallel.vocab_parallel_cross_entropy`` as Megatron ships it (no label smoothing), or over
        a one-rank CPU group the room's ``one_rank_loss`` when installed (``model/cpu_fastpaths.py``)."""
        if self.config.cross_entropy_loss_fusion:
            return self.gpt.compute_language_model_loss(labels, logits)
        labels = labels.transpose(0, 1).contiguous()  # [B, S] -> [S, B]
        loss = cpu_fastpaths.one_rank_cross_entropy(logits, labels)
        if loss is None:
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels)
        return loss.transpose(0, 1).contiguous()

    def rotary(self, positions: torch.Tensor):
        """RoPE frequencies for positions [B, S] (None without RoPE): per token [S, B, 1, D] on the dense
        path; on the packed path the plain table [P, 1, 1, D], which Megatron's THD RoPE maps from row 0
        in every packed sequence (``cu_seqlens``), so positions restart per document without a row per
        token (:func:`~fbt_megatron.model.attention.packed_rotary_length`)."""
        if self.model_config.position_embedding_type != "rope":
            return None
        if self.packed:
            return self.gpt.rotary_pos_emb(packed_rotary_length(self.model_config.max_sequence_length,
                                                                positions.numel()))
        table = self.gpt.rotary_pos_emb(self.model_config.max_sequence_length)  # [P, 1, 1, D]
        return rotary_for_positions(table, positions)

    # ----------------------------------------------------------------- forward
    def forward(self, input_ids, position_ids=None, doc_start=None, labels=None, num_passes: int = 1,
                jitter_seed: int | None = None, cu_seqlens=None, max_seqlen=None) -> FBTOutput:
        """[B, S] tokens -> FBTOutput. ``doc_start`` [B, S] marks document starts (state reset);
        ``jitter_seed`` seeds the training-time jitter (without it the jitter draws from torch's
        global generator, which is not reproducible across resumes); ``cu_seqlens``, ``max_seqlen``: the
        loader's packed documents of ``doc_start`` (``data_pipeline.documents``), derived here if not given."""
        check_num_passes(num_passes)
        if self.pipelined:
            raise RuntimeError("this FBTGPTModel is one pipeline stage; run it with "
                               "fbt_megatron.parallel.pipeline_runner (parallel.pipeline > 1)")
        batch, seq_len = input_ids.shape
        if self.config.sequence_parallel and seq_len % self.config.tensor_model_parallel_size:
            raise ValueError(f"sequence length {seq_len} is not divisible by tensor parallel size "
                             f"{self.config.tensor_model_parallel_size} (sequence parallelism splits it)")
        if self.packed and self.config.sequence_parallel and batch > 1:
            return self._rows_as_one(input_ids, position_ids, doc_start, labels, num_passes, jitter_seed,
                                     cu_seqlens, max_seqlen)
        reset = reset_positions(doc_start, batch, seq_len, input_ids.device)
        mask, positions = self.attention_inputs(reset, position_ids, cu_seqlens, max_seqlen)
        rotary = self.rotary(positions)
        # Token (+ position) embeddings, [S, B, D] ([S/TP, B, D] under sequence parallelism).
        embedded = self.gpt.embedding(input_ids=input_ids, position_ids=positions)

        fb = self.feedback
        if fb is None or (num_passes == 1 and fb.plain_first_pass):  # the ordinary transformer
            top = self.run_stack(embedded, mask, rotary)
            return self._output(self._full_sequence(top), labels, [self.head(top, labels)], [])

        generator = None
        if self.training and self.feedback_config.jitter_std > 0 and jitter_seed is not None:
            generator = torch.Generator(device=embedded.device).manual_seed(int(jitter_seed))

        cfg = self.feedback_config
        every_pass = cfg.loss_on == "mean" and self.training  # the mean over passes is a training loss
        # The token path of the fusion (sigmoid(W_G e) for glu) is the same in every pass: once per step.
        gate = fb.token_gate(self._full_sequence(embedded))
        top, heads, residuals = None, [], []
        for k in range(num_passes):
            last = k == num_passes - 1
            with torch.set_grad_enabled(torch.is_grad_enabled() and (last or cfg.grad_mode == "all")):
                stack_input = fb.pass_input(top, embedded, gate, reset, generator)
                local_top = self.run_stack(stack_input, mask, rotary)
                if last or every_pass:
                    heads.append(self.head(local_top, labels))
                new_top = self._full_sequence(local_top)
            if top is not None:
                with torch.no_grad():
                    residuals.append((new_top - top).norm() / top.norm().clamp_min(1e-12))
            top = new_top
        return self._output(top, labels, heads, residuals)

    def _rows_as_one(self, input_ids, position_ids, doc_start, labels, num_passes, jitter_seed, cu_seqlens=None,
                     max_seqlen=None) -> FBTOutput:
        """Packed attention under sequence parallelism: the B rows end to end as one row (each row start
        a document start), so the sequence split gives each TP rank a contiguous 1/TP of the packed tokens
        (Megatron's SP + THD layout); outputs come back in the rows' shapes. Each row's tokens see the same
        documents, positions and fed-back states as before: rows never share a document; the training jitter
        is drawn in the rows' order (``LatentFeedback.rows_as_one``)."""
        batch, seq_len = input_ids.shape
        starts = reset_positions(doc_start, batch, seq_len, input_ids.device).t()  # [B, S], row starts set

        def one_row(t):
            return None if t is None else t.reshape(1, -1)

        if self.feedback is not None:
            self.feedback.rows_as_one = batch
        try:
            out = self.forward(one_row(input_ids), one_row(position_ids), one_row(starts), one_row(labels),
                               num_passes, jitter_seed, cu_seqlens, max_seqlen)  # the same documents end to end
        finally:
            if self.feedback is not None:
                self.feedback.rows_as_one = None
        return FBTOutput(token_loss=None if out.token_loss is None else out.token_loss.reshape(batch, seq_len),
                         logits=None if out.logits is None else out.logits.reshape(batch, seq_len, -1),
                         hidden=from_packed(out.hidden, batch), pass_residuals=out.pass_residuals)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron's sharded state dict, with the vocabulary-parallel weights stored TP-independently
        (their logical rows in vocab_pad_multiple-row chunks, padding left out), so a checkpoint
        reloads under another TP size although the padded vocabulary depends on TP."""
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for name in ("gpt.embedding.word_embeddings.weight", "gpt.output_layer.weight"):
            if prefix + name in sd:
                sd[prefix + name] = vocab.chunked_vocab_factory(
                    sd[prefix + name], self.model_config.vocab_size, self.model_config.vocab_pad_multiple)
        return sd

    def _output(self, top, labels, heads, residuals) -> FBTOutput:
        out = FBTOutput(hidden=top, pass_residuals=residuals)
        if labels is None:
            out.logits = heads[-1]
        else:
            out.token_loss = heads[-1] if len(heads) == 1 else torch.stack(heads).mean(0)
        return out


def build_model(model: ModelConfig, feedback: FeedbackConfig, *, sequence_parallel: bool = False,
                dtype: torch.dtype | None = None, packed: bool | None = None) -> FBTGPTModel:
    """Build on the current device for the current Megatron parallel state (one pipeline stage
    under pipeline parallelism). Initial values depend on torch's RNG state on entry, not on the
    layout: one seed is drawn from it, and construction runs on generators seeded from that."""
    config = transformer_config(model, sequence_parallel=sequence_parallel, dtype=dtype)
    init_seed = int(torch.randint(0, 2**40, ()))
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(init_seed)
        fbt = FBTGPTModel(model, feedback, config, init_seed=init_seed + 1, packed=packed)
    return fbt.to(runtime.device())
