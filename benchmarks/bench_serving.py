"""vLLM serving speed: latent feedback (the fbt_megatron plugin) over standard decoding, and vLLM over `fbt generate`.

One model (a Llama-class stock-initialised model imported with a fresh GLU fusion), exported both ways
(`to-hf` and `to-hf --standard`), the same batch of prompts, greedy, fixed output length:
- vLLM tokens/s: the feedback export through the plugin (FUSED prefill) over the `--standard` export in
  stock vLLM (the paper's claim: two D x D matmuls per token, goal >= 0.95); and the same with one prefill
  pass (``prefill_passes: 1``), which leaves out FUSED's second pass over the prompt: the per-token cost of
  the feedback alone;
- vLLM feedback tokens/s over the project's generator (`FeedbackDecoder`, what `fbt generate` runs) in the
  same mode on the same checkpoint.
Tokens/s = generated tokens of the batch / wall seconds of one `generate` call (prefill included), median
of all timed calls: --rounds rounds, each an engine per variant in an order rotated every round, each
engine in a process of its own, as a server runs one (in one process each engine inherits what the
previous ones left: memory, threads), --repeat calls per engine after a warm-up call, and before them one
warm-up engine whose calls are not counted (``plan``; kept from the one-process placement, where the
first engine was seen 20x slower per call than the later ones on a loaded machine: it now warms the
machine and the OS's file cache).
Prints measured ratios; asserts nothing. vLLM runs in its own venv (tests/vllm_env.py, built on first use).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_serving.py [--hidden 256 --layers 4 --batch 8 --tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("FBT_DEVICE", "cpu")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import torch  # noqa: E402


def build(root: Path, args) -> list[list[int]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from fbt_megatron import runtime
    from fbt_megatron.hf.export import export_checkpoint
    from fbt_megatron.hf.importer import import_hf

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=512,
                      initializer_range=0.2, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(root / "llama")
    runtime.init_distributed()
    import_hf(root / "llama", root / "run", log=lambda *a: None)
    export_checkpoint(root / "run", root / "hf", log=lambda *a: None)
    export_checkpoint(root / "run", root / "std", standard=True, log=lambda *a: None)
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, args.vocab, (args.prompt - (b % 4) * (args.prompt // 8),), generator=g).tolist()
            for b in range(args.batch)]


EXPORTS = {"standard": "std", "feedback": "hf", "feedback, 1 prefill pass": "hf"}  # variant -> export
OVERRIDES = {"feedback, 1 prefill pass": {"prefill_passes": 1}}  # vLLM's hf_overrides of a variant


def plan(rounds: int) -> list[tuple[str, str]]:
    """(job name, export) in the order the engines start: a warm-up engine (not counted), then per round one
    engine per variant, the order rotated by one every round."""
    jobs = [("warmup", "std")]
    names = list(EXPORTS)
    for r in range(rounds):
        jobs += [(f"{name}#{r}", EXPORTS[name]) for name in names[r % len(names):] + names[:r % len(names)]]
    return jobs


def seconds_by_export(res: dict) -> dict[str, list[float]]:
    """Every timed call's seconds per variant, over the rounds (the warm-up engine left out)."""
    out: dict[str, list[float]] = {name: [] for name in EXPORTS}
    for job, r in res.items():
        name = job.split("#")[0]
        if name in out:
            out[name] += r["seconds"]
    return out


def fbt_generate_seconds(root: Path, prompts, args) -> list[float]:
    from fbt_megatron.generate.decoder import FeedbackDecoder
    from fbt_megatron.generate.loading import load_for_inference
    from fbt_megatron.generate.sampling import SamplingParams

    model = load_for_inference(root / "run", need_tokenizer=False).model
    dec = FeedbackDecoder(model, "feedback", 2)
    params = SamplingParams(max_new_tokens=args.tokens)
    dec.generate(prompts, params)
    out = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        dec.generate(prompts, params)
        out.append(time.perf_counter() - t)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import vllm_env

    python = vllm_env.ensure()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prompts = build(root, args)
        engine = {"max_model_len": 512, "max_num_batched_tokens": 4096, "skip_tokenizer_init": True}
        jobs = [{"name": name, "model": str(root / d), "prompts": prompts, "max_tokens": args.tokens,
                 "repeat": args.repeat if name != "warmup" else 1,
                 "engine": {**engine, **({"hf_overrides": OVERRIDES[variant]} if variant in OVERRIDES else {})}}
                for name, d in plan(args.rounds) for variant in [name.split("#")[0]]]
        env = dict(os.environ, PYTHONPATH=f"{vllm_env.plugin_path(root / 'plugin')}:{vllm_env.package_path(root / 'package')}", HF_HUB_OFFLINE="1",
                   VLLM_CPU_OMP_THREADS_BIND="nobind")
        res = {}
        for i, job in enumerate(jobs):  # an engine per process, as a server runs one
            request, result = root / f"request{i}.json", root / f"result{i}.json"
            request.write_text(json.dumps({"jobs": [job]}))
            subprocess.run([str(python), str(REPO / "tests" / "vllm_side.py"), str(request), str(result)],
                           env=env, check=True, cwd=root)
            res.update(json.loads(result.read_text()))
        fbt = fbt_generate_seconds(root, prompts, args)
    generated = args.batch * args.tokens
    seconds = {**seconds_by_export(res), "fbt generate": fbt}
    tps = {name: generated / statistics.median(sec) for name, sec in seconds.items()}
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; batch {args.batch}, prompts "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.tokens} new tokens, "
          f"threads {torch.get_num_threads()}; {args.rounds} rounds x {args.repeat} calls per export")
    for name, v in tps.items():
        print(f"  {name:>24}: {v:8.1f} tokens/s (median of {len(seconds[name])} calls; "
              f"{generated / max(seconds[name]):.1f}-{generated / min(seconds[name]):.1f})")
    print(f"vLLM feedback / vLLM standard: {tps['feedback'] / tps['standard']:.3f}  (goal >= 0.95)")
    print(f"vLLM feedback, 1 prefill pass / vLLM standard: {tps['feedback, 1 prefill pass'] / tps['standard']:.3f}"
          "  (FUSED's second prefill pass left out)")
    print(f"vLLM feedback / fbt generate (feedback, FUSED): {tps['feedback'] / tps['fbt generate']:.2f}")


if __name__ == "__main__":
    main()
