"""GPU smoke benchmark: run it on one GPU of a new cluster before a long run (about 5 minutes).

    python benchmarks/gpu_smoke.py [--recipe recipes/fbt-1b-400b.yaml] [--steps 5] [--passes 1,3]
                                   [--micro-batch N] [--equivalence-layers 2] [dotted.key=value ...]

On one GPU, with the Transformer Engine layer spec in bf16 (what `fbt train` builds on a GPU):
1. builds the recipe's model (default: the 1B recipe) and trains ``--steps`` timed steps (after one
   warm-up step) of 1-pass and of 3-pass batches of packed documents (document lengths drawn from a
   geometric distribution, mean 1/4 of the sequence) as ``fbt train`` does: the train step over
   DeepSpeed ZeRO-1 in bf16 (fp32 master weights, fp32 gradient accumulation, torch's fused AdamW);
2. prints per pass count: tokens/s, MFU (FLOPs counted as `fbt plan` counts them, against the GPU's
   dense bf16 peak), peak memory (``torch.cuda.max_memory_allocated``) next to `fbt plan`'s figure for
   the same layout (bf16 ZeRO-1 as the plan counts it; no reserve), and the attention backend that ran
   (``packed`` expected);
3. checks that the Transformer Engine spec (packed documents, THD) and Megatron's local spec (torch
   SDPA with the dense document mask) give the same loss on the same weights: a model of the recipe's
   width with ``--equivalence-layers`` layers, fp32 and bf16, 1 and 3 passes.

It refuses on a machine without CUDA or without transformer-engine, saying so; on CPU the speed
benchmark is benchmarks/bench_train.py. Exit status: 0 when every check passed, 1 when one failed,
2 when it refused.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def refuse_reason() -> str | None:
    """Why this machine cannot run the smoke benchmark (None when it can)."""
    import torch

    if os.environ.get("FBT_DEVICE", "").lower() == "cpu":
        return "FBT_DEVICE=cpu forces the CPU path; unset it on a GPU node"
    if not torch.cuda.is_available():
        return ("no CUDA GPU here (torch.cuda.is_available() is False): this benchmark measures the GPU path; "
                "on CPU run benchmarks/bench_train.py")
    try:
        import transformer_engine  # noqa: F401
    except ImportError as e:
        return f"transformer-engine is not importable ({e}): install the GPU extras, pip install -e '.[gpu]'"
    return None


def gpu_name_for_plan() -> str:
    import torch

    from fbt_megatron.launch.plan import DEVICES

    name = torch.cuda.get_device_name().lower()
    for key in sorted(DEVICES, key=len, reverse=True):  # "a100-40" before "a100"
        if key.split("-")[0] in name:
            if key == "a100-40" and torch.cuda.get_device_properties(0).total_memory > 50e9:
                continue
            return key
    raise SystemExit(f"gpu_smoke: unknown GPU {name!r}: add its dense bf16 peak and memory to "
                     f"fbt_megatron/launch/plan.py DEVICES")


def packed_batch(batch: int, seq: int, vocab: int, generator, device):
    """Token ids, labels, loss mask and document starts of ``batch`` rows of packed documents."""
    import torch

    ids = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
    p = 4.0 / seq  # geometric document lengths, mean seq / 4
    doc_start = torch.rand(batch, seq, generator=generator) < p
    doc_start[:, 0] = True
    return {"input_ids": ids[:, :-1].to(device), "labels": ids[:, 1:].to(device),
            "loss_mask": torch.ones(batch, seq, device=device), "doc_start": doc_start.to(device)}


def fusion_params(recipe) -> int:
    return 0 if recipe.feedback.fusion == "off" else 2 * recipe.model.hidden_size ** 2  # W_U, W_G


def matmul_params(recipe, model) -> int:
    """The stack's matmul parameters as `fbt plan` counts them (the embedding lookups and the fusion
    left out; the fusion is counted in the passes that run it)."""
    m = recipe.model
    n = sum(p.numel() for p in model.parameters())
    lookups = (0 if m.tie_embeddings else m.padded_vocab_size(1) * m.hidden_size) + \
        (m.max_sequence_length * m.hidden_size if m.position_embedding_type == "learned_absolute" else 0)
    return n - lookups - fusion_params(recipe)


class FixedPasses:
    """A pass schedule of ``passes`` at every step (what ``FBTTrainStep`` asks of ``PassSchedule``)."""

    def __init__(self, passes: int):
        self.passes = passes

    def num_passes(self, step: int) -> int:
        return self.passes


def engine_recipe(recipe, micro_batch: int):
    """``recipe`` as one GPU trains it in ``fbt train``: one micro-batch a step, DeepSpeed ZeRO-1, bf16
    (fp32 master weights and gradient accumulation, DeepSpeed's BF16_Optimizer)."""
    from fbt_megatron.recipe import load_recipe

    data = recipe.model_dump(mode="json", exclude_unset=True)
    data["batch"] = {"micro_batch_size": micro_batch, "global_batch_size": micro_batch}
    data["parallel"] = {**data.get("parallel", {}), "tensor": 1, "pipeline": 1, "zero_stage": 1}
    data["precision"] = "bf16"
    return load_recipe(data=data)


def train_steps(recipe, passes_list, steps: int, micro_batch: int, gpu: str | None, device=None) -> dict:
    """Per pass count in ``passes_list``: ``steps`` timed optimiser steps (after one warm-up) of batches of
    packed documents, through the engine ``fbt train`` uses (``FBTTrainStep`` over DeepSpeed,
    :func:`engine_recipe`), one model and engine for all pass counts. ``gpu``: ``fbt plan``'s device for the
    MFU and the memory figure (None: neither, e.g. on CPU). Returns {passes: measurements}."""
    import torch

    from fbt_megatron import runtime
    from fbt_megatron.engine import Engine
    from fbt_megatron.model.fbt_gpt import build_model
    from fbt_megatron.parallel.runner import get_runner
    from fbt_megatron.train.train_step import FBTTrainStep

    device = device or runtime.device()
    cuda = device.type == "cuda"
    recipe = engine_recipe(recipe, micro_batch)
    torch.manual_seed(0)
    model = build_model(recipe.model, recipe.feedback, dtype=torch.bfloat16).train()
    engine = Engine(model, recipe)
    runner = get_runner(engine.model, engine)
    seq, vocab = recipe.data.seq_length, recipe.model.vocab_size
    results, step_number = {}, 0
    for passes in passes_list:
        step_fn = FBTTrainStep(engine, runner, FixedPasses(passes), recipe.seed, device)
        g = torch.Generator().manual_seed(passes)
        batches = [packed_batch(micro_batch, seq, vocab, g, "cpu") for _ in range(steps + 1)]
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        for i, b in enumerate(batches):
            t0 = time.perf_counter()
            result = step_fn(step_number, [b], recipe.optimizer.lr)  # the loss .item() inside waits for the step
            step_number += 1
            if cuda:
                torch.cuda.synchronize()
            if i:  # the first step is the warm-up
                times.append(time.perf_counter() - t0)
            losses.append(result.loss)
        results[passes] = _measurements(recipe, engine, passes, micro_batch, sorted(times)[len(times) // 2], losses,
                                        gpu, torch.cuda.max_memory_allocated() / 1e9 if cuda else None)
    del runner, engine, model
    gc.collect()  # DeepSpeed's hooks hold the engine in reference cycles
    if cuda:
        torch.cuda.empty_cache()
    return results


def _measurements(recipe, engine, passes: int, micro_batch: int, step: float, losses: list, gpu: str | None,
                  peak_gb: float | None) -> dict:
    from fbt_megatron.launch.plan import DEVICES, Layout, Shape, memory_per_gpu
    from fbt_megatron.train.callbacks import model_flops_per_token

    seq = recipe.data.seq_length
    tokens_s = micro_batch * seq / step
    bare = engine.model
    masters = {str(p.dtype).replace("torch.", "") for group in engine.torch_optimizer.param_groups for p in group["params"]}
    result = {"passes": passes, "step_s": step, "tokens_s": tokens_s, "backend": bare.attention_backend,
              "losses": losses, "optimizer": type(engine.ds.optimizer).__name__, "master_dtypes": sorted(masters),
              "mfu": None, "peak_gb": peak_gb, "plan_gb": None}
    if gpu is not None:
        flops = model_flops_per_token(matmul_params(recipe, bare), recipe.model.num_layers, recipe.model.hidden_size,
                                      seq, passes, recipe.feedback.grad_mode, fusion_params(recipe),
                                      recipe.feedback.fused_first_pass)
        kept = passes if recipe.feedback.grad_mode == "all" else 1
        # fbt plan's bytes per parameter for bf16 ZeRO-1 (its defaults: fp32 masters and moments), no reserve
        predicted = memory_per_gpu(Shape.from_recipe(recipe), Layout(1, 1, 1, micro_batch), 1, kept, weight_bytes=2,
                                   act_bytes=2, flash=bare.attention_backend != "unfused",
                                   scores_transient=recipe.model.recompute == "selective", reserve=0.0)
        result.update(mfu=flops * tokens_s / DEVICES[gpu][0], plan_gb=predicted.total / 1e9)
    return result


def local_weights_from_te(te_state: dict) -> dict:
    """Transformer Engine fuses each layer's norms into the following linear layer
    (``linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``); Megatron's local spec keeps
    them as ``input_layernorm`` / ``pre_mlp_layernorm``. TE's ``_extra_state`` entries are dropped."""
    out = {}
    for name, value in te_state.items():
        if name.endswith("_extra_state"):
            continue
        name = name.replace("self_attention.linear_qkv.layer_norm_", "input_layernorm.")
        name = name.replace("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm.")
        out[name] = value
    return out


def equivalence(recipe, layers: int, micro_batch: int) -> list[tuple]:
    """(dtype, passes, TE loss, local loss, relative difference, tolerance) on the same weights."""
    import torch
    from megatron.core.models.gpt import gpt_layer_specs as specs

    from fbt_megatron.model.fbt_gpt import build_model

    small = recipe.model.model_copy(update={"num_layers": layers})
    seq, vocab = recipe.data.seq_length, small.vocab_size
    b = packed_batch(micro_batch, seq, vocab, torch.Generator().manual_seed(7), "cuda")
    rows = []
    for dtype, tol in ((torch.float32, 2e-3), (torch.bfloat16, 3e-2)):
        torch.manual_seed(0)
        te = build_model(small, recipe.feedback, dtype=dtype).eval()
        local_spec = specs.get_gpt_layer_local_spec(normalization=small.normalization)
        torch.manual_seed(0)
        local = build_model_with_spec(small, recipe.feedback, dtype, local_spec).eval()
        missing, unexpected = local.load_state_dict(local_weights_from_te(te.state_dict()), strict=False)
        missing = [n for n in missing if not n.endswith("_extra_state")]
        if missing or unexpected:
            raise SystemExit(f"gpu_smoke: TE -> local weight mapping incomplete: missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]}")
        for passes in (1, 3):
            with torch.no_grad():
                losses = [float(m(b["input_ids"], doc_start=b["doc_start"], labels=b["labels"],
                                  num_passes=passes).token_loss.float().mean()) for m in (te, local)]
            rel = abs(losses[0] - losses[1]) / abs(losses[1])
            rows.append((str(dtype).replace("torch.", ""), passes, losses[0], losses[1], rel, tol,
                         te.attention_backend, local.attention_backend))
        del te, local
        torch.cuda.empty_cache()
    return rows


def build_model_with_spec(model_cfg, feedback_cfg, dtype, spec):
    import torch

    from fbt_megatron import runtime
    from fbt_megatron.model.fbt_gpt import FBTGPTModel, transformer_config

    config = transformer_config(model_cfg, dtype=dtype)
    init_seed = int(torch.randint(0, 2**40, ()))
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(init_seed)
        fbt = FBTGPTModel(model_cfg, feedback_cfg, config, spec=spec, init_seed=init_seed + 1)
    return fbt.to(runtime.device())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*", help="dotted.key=value recipe overrides")
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "fbt-1b-400b.yaml"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--passes", default="1,3")
    ap.add_argument("--micro-batch", type=int, default=None, help="default: the recipe's micro_batch_size")
    ap.add_argument("--equivalence-layers", type=int, default=2)
    a = ap.parse_args(argv)
    reason = refuse_reason()
    if reason:
        print(f"gpu_smoke: refusing: {reason}", file=sys.stderr)
        return 2

    from fbt_megatron import runtime
    from fbt_megatron.recipe import load_recipe

    runtime.init_distributed()
    runtime.init_parallel_state(runtime.ParallelLayout())
    recipe = load_recipe(a.recipe, a.overrides)
    micro_batch = a.micro_batch or recipe.batch.micro_batch_size
    gpu = gpu_name_for_plan()
    import torch

    print(f"gpu_smoke: {recipe.name} on 1 x {torch.cuda.get_device_name()} (plan device {gpu}), bf16, "
          f"micro-batch {micro_batch} x {recipe.data.seq_length} tokens of packed documents, "
          f"grad_mode {recipe.feedback.grad_mode}, recompute {recipe.model.recompute}")
    ok = True
    print(f"{'passes':>6} {'step s':>7} {'tokens/s':>9} {'MFU':>6} {'peak GB':>8} {'plan GB':>8} {'attention':>10} "
          f"{'loss first -> last':>20}")
    for k, r in train_steps(recipe, [int(x) for x in a.passes.split(",")], a.steps, micro_batch, gpu).items():
        print(f"{k:>6} {r['step_s']:>7.3f} {r['tokens_s']:>9,.0f} {100 * r['mfu']:>5.1f}% {r['peak_gb']:>8.2f} "
              f"{r['plan_gb']:>8.2f} {r['backend']:>10} {r['losses'][0]:>9.4f} -> {r['losses'][-1]:.4f}")
        if r["backend"] != "packed":
            print(f"  FAIL: attention ran as {r['backend']!r}, not packed documents")
            ok = False
        if not all(math.isfinite(x) for x in r["losses"]):
            print("  FAIL: a loss is not finite")
            ok = False
    print(f"TE spec (packed, THD) vs local spec (SDPA, dense mask), same weights, {a.equivalence_layers} layers:")
    for dtype, k, te_loss, local_loss, rel, tol, te_backend, local_backend in equivalence(recipe, a.equivalence_layers,
                                                                                           micro_batch):
        verdict = "ok" if rel <= tol else "FAIL"
        ok &= rel <= tol
        print(f"  {dtype:>8} k={k}: {te_backend} {te_loss:.5f} vs {local_backend} {local_loss:.5f}, "
              f"relative difference {rel:.2e} (tolerance {tol:.0e}) {verdict}")
    print("gpu_smoke: all checks passed" if ok else "gpu_smoke: SOME CHECKS FAILED")
    runtime.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
