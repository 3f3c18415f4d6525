"""``fbt plan RECIPE --gpus N --gpu h100 [--mfu 0.40]``: what a recipe costs before it is launched.

Counts (all per token unless stated; N_mm = parameters that take part in matmuls; d = h/a the head
size, g the key/value heads (query groups; g = a without GQA), f the MLP width, m = 2 for SwiGLU's
[gate; up] fc1 and 1 for GELU; V the vocabulary padded to 128 x TP rows, as built):
- parameters: embedding V*h (+ S*h learned positions, + V*h untied output), per layer
  h(h + 2gd) + h^2 attention weights + (m + 1)hf MLP weights, biases (if add_bias_linear)
  h + 2gd + h + mf + h, norm weights 2 x (2h LayerNorm, h RMSNorm); final norm; feedback fusion
  W_U, W_G (2h^2) and h_init (h);
- forward FLOPs of the stack F = 2*N_mm + 4*L*S*h (QK^T and AV, full square as in Megatron's MFU
  convention), with N_mm = L(h(h + 2gd) + h^2 + (m + 1)hf) + V*h (output layer); of the fusion
  Phi = 2 * 2h^2 (W_U, W_G), in the passes that read a state (2..k; every pass under
  ``feedback.first_input: state``);
- a step with k passes costs k*F + (k-1)*Phi forward; backward twice its forward per pass with
  ``grad_mode: all`` (3(kF + (k-1)Phi) in all), or only for the last pass with ``grad_mode: last``.
  The 75/22/3 mix has E[k] = 1.28: about 1.28x a single-pass step with ``all`` (a little more with
  the fusion counted), (1.28+2)/3 = 1.09x with ``last``;
- memory per GPU (mixed precision: bf16 weights, fp32 gradient accumulation, fp32 master + Adam m, v;
  ZeRO-1 shards the 12 optimiser bytes over DP, ZeRO-2 also the 4 gradient bytes, ZeRO-3 also the
  weights; TP and PP divide all of them; DeepSpeed's bf16 ``.grad`` before it is added to the fp32
  accumulator, 2 bytes, all held at ZeRO-2/3, the largest parameter's at ZeRO-1, and over DP > 1 its
  flat reduction bucket of up to 5e8 elements, fp32 at ZeRO-0/1, bf16 at ZeRO-2/3), activations per layer and micro-batch s*b*h*(34 + 5as/h)
  bytes for the GPT block (Korthikanti et al. 2022; the 5as/h term only where attention runs unfused —
  ``model.attention.attention_backend``: Transformer Engine with a dense mask, i.e. an fp32 run on TE —
  and for one layer only with ``recompute: selective``; packed documents
  on TE, TE's causal flash and torch SDPA store no scores; 10 of
  the 34 replicated under TP without sequence parallelism), generalised: the TP-sharded 24 are
  Q, proj input (4) + K, V (4g/a) + the MLP's inner activations (4f/h for GELU: its input and fc2's;
  6f/h for SwiGLU: the 2f-wide [gate; up] and fc2's input), times the passes kept for backward (k with
  ``all``, 1 with ``last``: the deepest step must fit), times PP micro-batches in flight on the first
  stage, plus logits (6 bytes per s*b*V/TP) and a fixed reserve for the CUDA context, NCCL buffers and
  fragmentation;
- time at a stated MFU: tokens/s = MFU * peak * GPUs / (FLOPs per token).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass, field

from data_pipeline.argtypes import number, positive_int

GB = 1e9

# Dense bf16 peak FLOP/s and memory per device. "cpu" is measured (a matmul rate) when asked for.
DEVICES = {
    "h100": (989e12, 80 * GB), "h200": (989e12, 141 * GB), "a100": (312e12, 80 * GB),
    "a100-40": (312e12, 40 * GB), "b200": (2250e12, 180 * GB), "mi300x": (1307e12, 192 * GB),
    "l40s": (362e12, 48 * GB),
}


@dataclass
class Shape:
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    tied: bool = True
    learned_positions: bool = False
    fusion: bool = True  # feedback fusion weights exist (fusion != off)
    fused_first_pass: bool = False  # feedback.first_input: state (the fusion runs in pass 1 too)
    norm_params: int = 2  # LayerNorm: weight + bias; RMSNorm: weight
    query_groups: int | None = None  # key/value heads (GQA); None: one per head
    gated: bool = False  # SwiGLU: fc1 is [gate; up], 2f wide
    bias: bool = True  # add_bias_linear

    @classmethod
    def from_recipe(cls, r) -> "Shape":
        m = r.model
        return cls(layers=m.num_layers, hidden=m.hidden_size, heads=m.num_attention_heads,
                   ffn=m.ffn_size, vocab=m.padded_vocab_size(r.parallel.tensor), seq=r.data.seq_length,
                   tied=m.tie_embeddings, learned_positions=m.position_embedding_type == "learned_absolute",
                   fusion=r.feedback.fusion != "off", fused_first_pass=r.feedback.fused_first_pass,
                   norm_params=2 if m.normalization == "LayerNorm" else 1,
                   query_groups=m.num_query_groups, gated=m.activation == "swiglu", bias=m.add_bias_linear)

    @property
    def kv_width(self) -> int:
        """Output width of K (and of V): g key/value heads of size h/a."""
        return (self.query_groups or self.heads) * (self.hidden // self.heads)

    def layer_matmul_params(self) -> int:
        h, f = self.hidden, self.ffn
        return h * (h + 2 * self.kv_width) + h * h + (3 if self.gated else 2) * h * f

    def params(self, fusion_bias: bool = False) -> int:
        h, f = self.hidden, self.ffn
        biases = (h + 2 * self.kv_width) + h + (2 if self.gated else 1) * f + h  # qkv, proj, fc1, fc2
        per_layer = self.layer_matmul_params() + (biases if self.bias else 0) + 2 * self.norm_params * h
        n = self.layers * per_layer + self.norm_params * h + self.vocab * h
        n += 0 if self.tied else self.vocab * h
        n += self.seq * h if self.learned_positions else 0
        if self.fusion:
            n += 2 * h * h + h + (2 * h if fusion_bias else 0)
        return n

    def matmul_params(self) -> int:
        """The stack's matmul parameters (layers and output layer; the fusion is counted apart)."""
        return self.layers * self.layer_matmul_params() + self.vocab * self.hidden

    def largest_param(self) -> int:
        """Elements of the largest single weight: the embedding or LM head (V x h), else the MLP's fc1."""
        return max(self.vocab * self.hidden, (2 if self.gated else 1) * self.ffn * self.hidden)

    def fusion_params(self) -> int:
        return 2 * self.hidden * self.hidden if self.fusion else 0  # W_U, W_G

    def forward_flops_per_token(self) -> float:
        """One forward of the stack (embedding to logits), without the fusion."""
        return 2.0 * self.matmul_params() + 4.0 * self.layers * self.seq * self.hidden

    def step_flops_per_token(self, passes: int, grad_mode: str = "all") -> float:
        """Training FLOPs per token of a ``passes``-pass step, the fusion only where a pass reads a state."""
        from fbt_megatron.passes import step_flops

        return step_flops(passes, grad_mode, self.forward_flops_per_token(), 2.0 * self.fusion_params(),
                          self.fused_first_pass)


def pass_factor(mix: list[float], grad_mode: str, shape: Shape) -> float:
    """Training FLOPs of the mix relative to a single-pass step of ``shape`` (the fusion counted where
    it runs; without a fusion, 3kF or (k+2)F over 3F)."""
    return sum(p * shape.step_flops_per_token(i + 1, grad_mode) for i, p in enumerate(mix)) / \
        shape.step_flops_per_token(1, grad_mode)


def max_passes(mix: list[float]) -> int:
    return max(i + 1 for i, p in enumerate(mix) if p > 0)


@dataclass
class Layout:
    tp: int = 1
    pp: int = 1
    zero: int = 1
    micro_batch: int = 1
    sequence_parallel: bool = False

    def __str__(self) -> str:
        sp = "+SP" if self.sequence_parallel and self.tp > 1 else ""
        return f"TP={self.tp}{sp} PP={self.pp} ZeRO-{self.zero} micro-batch {self.micro_batch}"


@dataclass
class Memory:
    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    reserve: float
    detail: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.logits + self.reserve


def memory_per_gpu(shape: Shape, layout: Layout, dp: int, passes_kept: int, *, weight_bytes: int = 2,
                   grad_bytes: int = 4, optimizer_bytes: int = 12, act_bytes: int = 2, flash: bool = True,
                   reserve: float = 5 * GB, scores_transient: bool = False, half_grad_bytes: int = 0,
                   half_grads_released: bool = False, reduce_bucket_bytes: float = 0.0) -> Memory:
    """Bytes per GPU. ``passes_kept``: passes whose activations are alive at the backward (k for
    grad_mode all, 1 for last). CPU fp32: weight_bytes=4, act_bytes=4, reserve=0. ``flash=False``: the
    attention stores 5as^2b bytes of scores per layer (unfused); ``scores_transient``: only one
    layer's at a time (selective recompute of the core attention).
    ``half_grad_bytes``: the bf16 ``.grad`` backward writes before DeepSpeed adds it to the fp32
    accumulator (2 in bf16 mixed precision), all of them held, or with ``half_grads_released``
    (``bf16.immediate_grad_update``) the largest parameter's only; ``reduce_bucket_bytes``: bytes per
    element of DeepSpeed's flat reduction bucket (``REDUCE_BUCKET_ELEMENTS`` elements at most)."""
    from fbt_megatron.engine.deepspeed_config import REDUCE_BUCKET_ELEMENTS

    n = shape.params() / (layout.tp * layout.pp)
    weights = n * weight_bytes / (dp if layout.zero >= 3 else 1)
    # ZeRO-2 shards the gradients, except under a pipeline: there the step's gradients are summed whole
    # and reduced once (parallel/pipeline_runner.py StepGradients), held as ZeRO-1 holds them
    grads = n * grad_bytes / (dp if layout.zero >= 2 and layout.pp == 1 else 1)
    half_grads = (shape.largest_param() / layout.tp if half_grads_released else n) * half_grad_bytes
    buckets = min(n, REDUCE_BUCKET_ELEMENTS) * reduce_bucket_bytes
    grads += half_grads + buckets
    optimizer = n * optimizer_bytes / (dp if layout.zero >= 1 else 1)
    s, b, h, a, t = shape.seq, layout.micro_batch, shape.hidden, shape.heads, layout.tp
    # Korthikanti et al.: 34 sbh bytes at 2-byte activations (24 of them in TP-sharded matmul inputs,
    # 10 in norms/dropout/residuals, sharded only with sequence parallelism), + 5as^2 b for the scores.
    # The 24 are Q and the projection's input (4), K and V (4, 4g/a with GQA) and the MLP's 16 (GELU
    # at f = 4h: 4f/h; SwiGLU keeps its 2f-wide input and fc2's f-wide input: 6f/h).
    mlp_inner = (6.0 if shape.gated else 4.0) * shape.ffn / h
    sharded = (4.0 + 4.0 * shape.kv_width / h + mlp_inner) / t
    replicated = 10.0 / (t if layout.sequence_parallel else 1)
    scores = 0.0 if flash else 5.0 * a * s * s * b / t * act_bytes / 2.0
    per_layer = s * b * h * (sharded + replicated) * act_bytes / 2.0 + (0.0 if scores_transient else scores)
    layers_here = shape.layers / layout.pp
    p, k = layout.pp, passes_kept
    # Stage-pass activations the first stage holds at its peak (docs/pipeline.md, parallel/schedule.py):
    # P at k = 1 (1F1B), 2(P-1) + (k-1)P + 1 with k kept passes; PP=1 keeps k passes of one micro-batch.
    held = k if p == 1 else (p if k == 1 else 2 * (p - 1) + (k - 1) * p + 1)
    activations = per_layer * layers_here * held + (scores if scores_transient else 0.0)
    logits = s * b * shape.vocab / t * (act_bytes + 4)  # logits + fp32 softmax for the loss
    return Memory(weights, grads, optimizer, activations, logits, reserve,
                  {"params_per_gpu": n, "per_layer_activation": per_layer, "half_grads": half_grads,
                   "reduce_buckets": buckets})


def gradient_buffers(zero: int, dp: int, fp32: bool) -> dict:
    """DeepSpeed's gradient memory beyond the fp32 accumulator (``memory_per_gpu``'s keywords). bf16: the
    bf16 ``.grad`` of every parameter (ZeRO-1 releases each as it is added: ``bf16.immediate_grad_update``,
    ``engine/deepspeed_config.py``); over DP > 1 a flat reduction bucket, fp32 for ZeRO-0/1 (the bf16
    optimiser reduces its fp32 accumulators), bf16 for ZeRO-2/3 (ZeRO reduces the bf16 gradients)."""
    kw = {} if fp32 else {"half_grad_bytes": 2, "half_grads_released": zero == 1}
    if dp > 1:
        kw["reduce_bucket_bytes"] = 4 if fp32 or zero <= 1 else 2
    return kw


@dataclass
class Plan:
    shape: Shape
    params: int
    flops_per_token_single: float  # training, one pass (3F)
    factor_feedback: float
    phases: list[dict]
    memory: Memory
    layout: Layout
    dp: int
    fits: bool
    capacity: float
    suggestion: tuple[Layout, Memory] | None
    tokens_per_s: float
    warnings: list[str]
    attention: str = "packed"  # model.attention.attention_backend of the run


def _divides(shape: Shape, tp: int) -> bool:
    return all(x % tp == 0 for x in (shape.hidden, shape.heads, shape.query_groups or shape.heads, shape.ffn))


def suggest_layout(shape, gpus, global_batch, capacity, passes_kept, mem_kw, gpus_per_node=8, allow_pp=False):
    """The cheapest layout that fits: ZeRO-3 only if nothing else fits (it all-gathers the weights for
    every micro-batch and every pass: 3x for a 3-pass step), then the smallest TP*PP (least
    communication; TP stays within a node), then the lowest ZeRO stage, then the largest micro-batch."""
    best = None
    pps = [p for p in (1, 2, 4, 8, 16) if shape.layers % p == 0] if allow_pp else [1]
    for tp, pp, zero in itertools.product((1, 2, 4, 8), pps, (1, 2, 3)):
        if tp > gpus_per_node or gpus % (tp * pp) or not _divides(shape, tp):
            continue
        if pp > 1 and zero == 3:  # the pipeline runs ZeRO 0-2 (docs/pipeline.md)
            continue
        dp = gpus // (tp * pp)
        for mb in (16, 8, 4, 2, 1):
            if global_batch % (mb * dp):
                continue
            lay = Layout(tp, pp, zero, mb, sequence_parallel=tp > 1)
            buffers = gradient_buffers(zero, dp, mem_kw.get("weight_bytes") == 4)
            mem = memory_per_gpu(shape, lay, dp, passes_kept, **{**mem_kw, **buffers})
            if mem.total <= capacity:
                key = (zero == 3, tp * pp, pp, zero, -mb)
                if best is None or key < best[0]:
                    best = (key, lay, mem)
                break
    return None if best is None else (best[1], best[2])


def plan(recipe, gpus: int, gpu: str, mfu: float, *, peak: float | None = None, capacity: float | None = None,
         gpus_per_node: int = 8, layout: Layout | None = None, flash: bool | None = None,
         reserve: float | None = None, fp32: bool = False, te: bool = True) -> Plan:
    """``te``: the GPU run has transformer-engine (``pip install -e '.[gpu]'``), so its layers are TE's;
    the attention backend follows (``model.attention.attention_backend``). ``flash`` overrides it."""
    import torch

    from fbt_megatron.model.attention import attention_backend

    shape = Shape.from_recipe(recipe)
    if gpu != "cpu":
        peak = peak or DEVICES[gpu][0]
        capacity = capacity or DEVICES[gpu][1]
    p = recipe.parallel
    layout = layout or Layout(p.tensor, p.pipeline, p.zero_stage, recipe.batch.micro_batch_size, p.sequence_parallel)
    warnings = []
    if gpus % (layout.tp * layout.pp):
        raise ValueError(f"--gpus {gpus} is not divisible by TP={layout.tp} x PP={layout.pp}")
    dp = gpus // (layout.tp * layout.pp)
    g = recipe.global_batch_size
    if g % (layout.micro_batch * dp):
        warnings.append(f"global batch {g} is not divisible by micro-batch {layout.micro_batch} x DP {dp}")
    mix, grad_mode = recipe.schedule.mix, recipe.feedback.grad_mode
    kmax = max_passes(mix) if shape.fusion else 1
    passes_kept = kmax if grad_mode == "all" else 1
    if recipe.schedule.feedback_start_step >= recipe.train.steps:
        passes_kept = 1
    full = fp32 or recipe.precision == "fp32"  # fp32 training ("auto" is bf16 on a GPU)
    backend = attention_backend(te and gpu != "cpu", recipe.model.attention_mask,
                                torch.float32 if full else torch.bfloat16)
    mem_kw = dict(weight_bytes=4 if full else 2, act_bytes=4 if full else 2,
                  flash=backend != "unfused" if flash is None else flash,
                  scores_transient=recipe.model.recompute == "selective",
                  reserve=(0.0 if fp32 else 5 * GB) if reserve is None else reserve)
    if full:  # fp32 training: the weights are the masters; no separate fp32 copy
        mem_kw.update(grad_bytes=4, optimizer_bytes=8 if layout.zero == 0 else 12)
    mem_kw.update(gradient_buffers(layout.zero, dp, full))  # suggest_layout replaces these per layout
    memory = memory_per_gpu(shape, layout, dp, passes_kept, **mem_kw)
    fits = capacity is None or memory.total <= capacity
    if not fits and not mem_kw["flash"]:
        flash_total = memory_per_gpu(shape, layout, dp, passes_kept, **{**mem_kw, "flash": True}).total
        if flash_total <= capacity:
            warnings.append(f"the layout does not fit because attention runs unfused ({backend}: TE with a dense "
                            f"document mask, 5as/h bytes of scores per layer); with packed documents it needs "
                            f"{flash_total / GB:.2f} GB: train in bf16 (precision: bf16)")
    suggestion = None
    if not fits:
        suggestion = suggest_layout(shape, gpus, g, capacity, passes_kept, mem_kw, gpus_per_node) \
            or suggest_layout(shape, gpus, g, capacity, passes_kept, mem_kw, gpus_per_node, allow_pp=True)
        if suggestion and suggestion[0].pp > 1:
            warnings.append("the suggested layout needs pipeline parallelism (parallel.pipeline; ZeRO <= 2 there, "
                            "docs/pipeline.md)")
    single = shape.step_flops_per_token(1, grad_mode)
    factor = pass_factor(mix, grad_mode, shape) if shape.fusion else 1.0
    tokens_per_step = recipe.tokens_per_step
    # a model without a fusion runs one pass every step: all of it is the single-pass phase
    start = min(recipe.schedule.feedback_start_step, recipe.train.steps) if shape.fusion else recipe.train.steps
    phases = []
    for name, steps, f, kept in (("1: single-pass", start, 1.0, 1),
                                 (f"2: feedback mix {mix}", recipe.train.steps - start, factor, passes_kept)):
        if steps <= 0:
            continue
        phase_memory = memory_per_gpu(shape, layout, dp, kept, **mem_kw)  # its deepest step
        tokens = steps * tokens_per_step
        flops = tokens * single * f
        seconds = flops / (mfu * peak * gpus)
        phases.append({"name": name, "steps": steps, "tokens": tokens, "flops": flops, "seconds": seconds,
                       "gpu_hours": seconds * gpus / 3600, "tokens_per_s": tokens / seconds,
                       "step_seconds": seconds / steps, "flops_per_token": single * f,
                       "memory": phase_memory, "passes_kept": kept,
                       "fits": capacity is None or phase_memory.total <= capacity})
    return Plan(shape, shape.params(recipe.feedback.bias), single, factor, phases, memory, layout, dp, fits,
                capacity or float("inf"), suggestion, phases[0]["tokens_per_s"] if phases else 0.0, warnings,
                backend)


ATTENTION_WORDS = {
    "packed": "packed documents (THD, cu_seqlens from doc_start; TE flash/fused): no S x S scores",
    "flash": "causal (TE flash/fused): no S x S scores",
    "sdpa": "torch SDPA with the dense mask (Megatron's local layers): no S x S scores stored",
    "unfused": "TE unfused with a dense [B,1,S,S] mask: 5as/h bytes of scores per layer",
    "packed-unfused": "packed documents on TE's unfused backend (TE >= 2.11, fp32): scores per document",
}


def _fmt_time(s: float) -> str:
    if s >= 86400:
        return f"{s / 86400:.1f} days"
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    return f"{s:.3g} s" if s < 60 else f"{s / 60:.1f} min"


def _fmt_mem(m: Memory) -> str:
    parts = [("weights", m.weights), ("grads", m.grads), ("optimiser", m.optimizer),
             ("activations", m.activations), ("logits", m.logits), ("reserve", m.reserve)]
    return ", ".join(f"{k} {v / GB:.2f}" for k, v in parts) + f" = {m.total / GB:.2f} GB"


def format_plan(pl: Plan, recipe, gpus: int, gpu: str, mfu: float, peak: float) -> str:
    s = pl.shape
    tokens = sum(p["tokens"] for p in pl.phases)
    lines = [
        f"plan: {recipe.name} on {gpus} x {gpu} at {100 * mfu:.0f}% MFU (peak {peak / 1e12:.4g} TFLOP/s per device)",
        f"model        {pl.params / 1e9:.3f} B parameters ({pl.params:,}); L={s.layers} h={s.hidden} heads={s.heads} "
        + (f"kv-heads={s.query_groups} " if s.query_groups else "")
        + f"ffn={s.ffn}{' (SwiGLU)' if s.gated else ''} V={s.vocab} seq={s.seq}"
        + ("" if s.tied else " untied"),
        f"FLOPs/token  {pl.flops_per_token_single:.4g} single-pass training (3 x forward {s.forward_flops_per_token():.4g}"
        f"{'' if s.fused_first_pass or not s.fusion else '; the fusion runs from pass 2'}); "
        + (f"feedback mix x{pl.factor_feedback:.3f} ({recipe.feedback.grad_mode} passes backpropagated)"
           if s.fusion else "no feedback mix (feedback.fusion: off, one pass every step)"),
        f"batch        {recipe.global_batch_size} seq x {s.seq} = {recipe.tokens_per_step:,} tokens/step, "
        f"{recipe.train.steps:,} steps = {tokens / 1e9:.4g} B tokens",
        f"layout       {pl.layout}, DP={pl.dp}, accumulation {recipe.global_batch_size // max(1, pl.layout.micro_batch * pl.dp)}",
        f"attention    {recipe.model.attention_mask}: {ATTENTION_WORDS[pl.attention]}",
        f"memory/GPU   {_fmt_mem(pl.memory)}" + (f" of {pl.capacity / GB:.0f} GB" if pl.capacity < float("inf") else ""),
    ]
    if not pl.fits:
        lines.append(f"WARNING      this layout does not fit in {pl.capacity / GB:.0f} GB")
        if pl.suggestion:
            lay, mem = pl.suggestion
            lines.append(f"suggestion   {lay}: {mem.total / GB:.2f} GB ({_fmt_mem(mem)})")
        else:
            lines.append("suggestion   none found up to TP=8, PP=16, ZeRO-3, micro-batch 1: more GPUs or memory")
    total_s = total_h = 0.0
    for p in pl.phases:
        total_s += p["seconds"]
        total_h += p["gpu_hours"]
        lines.append(f"phase {p['name']}: {p['steps']:,} steps, {p['tokens'] / 1e9:.4g} B tokens, "
                     f"{p['tokens_per_s'] / gpus:,.0f} tokens/s/GPU ({p['tokens_per_s']:,.0f} total), "
                     f"{p['step_seconds']:.3g} s/step, {_fmt_time(p['seconds'])}, {p['gpu_hours']:,.0f} GPU-hours, "
                     f"{p['memory'].total / GB:.2f} GB/GPU at {p['passes_kept']} kept pass(es)"
                     + ("" if p["fits"] else " (DOES NOT FIT)"))
    lines.append(f"total        {_fmt_time(total_s)} wall, {total_h:,.0f} GPU-hours")
    lines += [f"note         {w}" for w in pl.warnings]
    return "\n".join(lines)


def measure_cpu_peak(n: int = 1024, repeats: int = 5) -> float:
    """fp32 matmul FLOP/s of this machine with torch's threads (the 'peak' for --gpu cpu)."""
    import time

    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fbt plan", description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value recipe overrides")
    ap.add_argument("--gpus", type=positive_int, required=True)
    ap.add_argument("--gpu", default="h100", choices=[*DEVICES, "cpu"])
    ap.add_argument("--mfu", type=number(float, gt=0, le=1), default=0.40, help="model FLOPs utilisation assumed (default 0.40)")
    ap.add_argument("--peak-tflops", type=number(float, gt=0), default=None, help="override the device's peak")
    ap.add_argument("--memory-gb", type=number(float, gt=0), default=None, help="override the device's memory")
    ap.add_argument("--gpus-per-node", type=positive_int, default=8)
    ap.add_argument("--no-te", action="store_true",
                    help="the GPUs run without transformer-engine (Megatron's local layers, torch SDPA)")
    a = ap.parse_intermixed_args(argv)
    from fbt_megatron.recipe import RecipeError, load_recipe
    from fbt_megatron.resolve.plan import Environment
    from fbt_megatron.resolve.resolver import resolve_run

    try:  # the run plan `fbt train` starts from, on --gpus processes (the data need not be on this machine)
        recipe = resolve_run(load_recipe(a.recipe, a.overrides), a.gpus, Environment.nodes(gpu=a.gpu != "cpu"),
                             data_files=False).recipe
    except (RecipeError, FileNotFoundError) as e:
        print(f"fbt plan: {e}", file=sys.stderr)
        return 2
    peak = a.peak_tflops * 1e12 if a.peak_tflops else (measure_cpu_peak() if a.gpu == "cpu" else DEVICES[a.gpu][0])
    cap = a.memory_gb * GB if a.memory_gb else None
    try:
        pl = plan(recipe, a.gpus, a.gpu, a.mfu, peak=peak, capacity=cap, gpus_per_node=a.gpus_per_node,
                  fp32=a.gpu == "cpu", te=not a.no_te)
    except ValueError as e:
        print(f"fbt plan: {e}", file=sys.stderr)
        return 2
    print(format_plan(pl, recipe, a.gpus, a.gpu, a.mfu, peak))
    return 0


if __name__ == "__main__":
    sys.exit(main())
