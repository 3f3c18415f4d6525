"""vLLM serving speed: latent feedback (the fbt_megatron plugin) over standard decoding, and vLLM over `fbt generate`.

One model (a Llama-class stock-initialised model imported with a fresh GLU fusion), exported both ways
(`to-hf` and `to-hf --standard`), the same batch of prompts, greedy, fixed output length:
- vLLM tokens/s: the feedback export through the plugin (FUSED prefill) over the `--standard` export in
  stock vLLM (the paper's claim: two D x D matmuls per token, one with the plugin's gate table; goal >= 0.95); and the same with one prefill
  pass (``prefill_passes: 1``), which leaves out FUSED's second pass over the prompt: the per-token cost of
  the feedback alone;
- vLLM feedback tokens/s over the project's generator (`FeedbackDecoder`, what `fbt generate` runs) in the
  same mode on the same checkpoint.
Tokens/s = generated tokens of the batch / wall seconds of one `generate` call (prefill included), median
of the timed calls. Each variant's engine runs in a process of its own (as a server runs one) kept for the
whole run, and the engines take turns: one untimed round, then --rounds rounds of one call per engine in
an order that cycles through every ordering of the variants, so drifting machine load hits every variant
alike and none always runs first or right after the same one; the ratio is printed of the medians and per
round (standard's call over the variant's in that round: median and range). ``--sessions N`` starts the
engines afresh N times (--rounds rounds each) and prints each session's per-round median too: two runs of
the same command differed more than the rounds of one run did (one prefill pass 0.981 and 0.931), so where an
engine's process lies weighs in, and fresh processes average it out. Before,
each engine ran its calls in one go, one engine after the other (and standard served the repeated prompts
from its prefix cache); the calls of one engine ranged over ±20 %: two runs on the idle machine gave FUSED /
standard 0.914 and 0.778. Each engine makes two untimed calls (one at its start, one in the untimed round).
Prints measured ratios; asserts nothing. vLLM runs in its own venv (tests/support/vllm_env.py, built on first use).

    .venv/bin/python benchmarks/bench_serving.py [--hidden 1024 --layers 8 --batch 8 --tokens 64 --rounds 6 --sessions 3]

The defaults are the goal's measurement in docs/serving.md; `--hidden 256 --layers 4`
is the small, dispatch-bound model also reported there.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import select
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("FBT_DEVICE", "cpu")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

REPO = Path(__file__).resolve().parent.parent

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


def balanced_cycle(names: list[str]) -> list[list[str]]:
    """A cycle of every ordering of ``names`` whose calls, run back to back and round after round, put each
    variant right after each other one equally often and never twice in a row (the first call of a round
    follows the last of the one before). Searched once: 720 candidate cycles for 3 variants."""
    perms = [list(p) for p in itertools.permutations(names)]
    for rest in itertools.permutations(perms[1:]):
        cycle = [perms[0], *rest]
        calls = [n for turn in cycle for n in turn]
        pairs = Counter(zip(calls, calls[1:] + calls[:1]))
        if all(a != b for a, b in pairs) and len(set(pairs.values())) == 1:
            return cycle
    raise ValueError(f"no balanced cycle of orderings for {names}")


def order(rounds: int) -> list[list[str]]:
    """The variants' turns in each round: a balanced cycle of every ordering (6 for 3), so over each cycle every
    variant runs first equally often and runs right after each other variant equally often (a rotation kept
    the same successor: standard always ran right after the 1-pass variant). Balanced when ``rounds`` is a
    multiple of the cycle's length."""
    cycle = balanced_cycle(list(EXPORTS))
    return [cycle[r % len(cycle)] for r in range(rounds)]


def paired_ratios(seconds: dict[str, list[float]], name: str) -> list[float]:
    """Per round: standard's seconds / ``name``'s seconds (= name's tokens/s over standard's) in that round."""
    return [s / v for s, v in zip(seconds["standard"], seconds[name])]


class EngineProcess:
    """One variant's vLLM engine in a process of its own (as a server runs one), kept for the whole run
    (``tests/support/side/vllm_side.py --calls``): calling it makes one timed ``generate`` there and returns its seconds.
    A child that dies, or answers nothing within ``timeout`` seconds, is an error naming it with its log's
    tail (the child is killed)."""

    def __init__(self, python: Path, job: dict, env: dict, root: Path, slug: str, timeout: float = 900.0):
        (root / f"{slug}.json").write_text(json.dumps(job))
        self.name, self.log, self.timeout = job["name"], root / f"{slug}.log", timeout
        read, write = os.pipe()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [str(python), str(REPO / "tests" / "support" / "side" / "vllm_side.py"), "--calls", str(root / f"{slug}.json"),
                 str(write)], stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
                cwd=root, pass_fds=(write,))
        os.close(write)  # the child's end: a dying child is an end of file at once
        self.answers = os.fdopen(read)
        try:
            self._answer()  # started, and its untimed first call made
        except BaseException:
            self.close()
            raise

    def _fail(self, what: str):
        self.proc.kill()
        code = self.proc.wait()
        raise RuntimeError(f"the {self.name!r} engine's process {what} (exit {code}):\n{self.log.read_text()[-3000:]}")

    def _answer(self) -> dict:
        if not select.select([self.answers], [], [], self.timeout)[0]:
            self._fail(f"answered nothing in {self.timeout:.0f} s")
        line = self.answers.readline()
        if not line:
            self._fail("ended")
        return json.loads(line)

    def __call__(self) -> float:
        try:
            self.proc.stdin.write("call\n")
            self.proc.stdin.flush()
        except OSError:  # the child is gone
            self._fail("ended")
        return self._answer()["seconds"]

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.answers.close()


def timed_rounds(engines: dict, rounds: int) -> dict[str, list[float]]:
    """One untimed round, then ``rounds`` rounds of one call per engine in ``order``'s turns: seconds per
    variant."""
    seconds = {name: [] for name in engines}
    for r, turn in enumerate(order(rounds + 1)):
        for name in turn:
            took = engines[name]()
            if r:
                seconds[name].append(took)
    return seconds


def timed_sessions(start, sessions: int, rounds: int) -> tuple[dict[str, list[float]], list[dict[str, list[float]]]]:
    """``sessions`` times: fresh engines (``start(session, i, name)`` for each variant, one after the other: a
    start takes both cores), ``rounds`` timed rounds, the engines closed. Seconds per variant over all
    sessions, and per session."""
    pooled, each = {name: [] for name in EXPORTS}, []
    for session in range(sessions):
        engines = {}
        try:
            for i, name in enumerate(EXPORTS):
                engines[name] = start(session, i, name)
            each.append(timed_rounds(engines, rounds))
        finally:
            for e in engines.values():
                e.close()
        for name, took in each[-1].items():
            pooled[name] += took
    return pooled, each


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
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="fbt generate's timed calls")
    ap.add_argument("--rounds", type=int, default=6, help="per session; a multiple of 6 balances the turns")
    ap.add_argument("--sessions", type=int, default=3, help="start the engines afresh this many times (module doc)")
    args = ap.parse_args()
    if args.sessions < 1:
        ap.error(f"--sessions {args.sessions}: at least 1")
    from harness import repo_module

    vllm_env = repo_module("tests/support/vllm_env.py")
    python = vllm_env.ensure()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prompts = build(root, args)
        # Prefix caching off for every variant: the calls repeat the same prompts, which the cache would serve
        # to standard without a prefill, while the plugin's config hook turns it off for any K-pass prefill
        # (one pass included); a server's prompts differ.
        engine = {"max_model_len": 512, "max_num_batched_tokens": 4096, "skip_tokenizer_init": True,
                  "enable_prefix_caching": False}
        env = dict(os.environ, PYTHONPATH=f"{vllm_env.plugin_path(root / 'plugin')}:{vllm_env.package_path(root / 'package')}", HF_HUB_OFFLINE="1",
                   VLLM_CPU_OMP_THREADS_BIND="nobind")

        def start(session, i, name):
            job = {"name": name, "model": str(root / EXPORTS[name]), "prompts": prompts, "max_tokens": args.tokens,
                   "engine": {**engine, **({"hf_overrides": OVERRIDES[name]} if name in OVERRIDES else {})}}
            return EngineProcess(python, job, env, root, f"engine{session}-{i}")

        seconds, sessions = timed_sessions(start, args.sessions, args.rounds)
        seconds["fbt generate"] = fbt_generate_seconds(root, prompts, args)
    generated = args.batch * args.tokens
    tps = {name: generated / statistics.median(sec) for name, sec in seconds.items()}
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; batch {args.batch}, prompts "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.tokens} new tokens, "
          f"threads {torch.get_num_threads()}; {args.rounds} rounds of one call per engine (fbt generate: "
          f"{args.repeat} calls)")
    for name, v in tps.items():
        print(f"  {name:>24}: {v:8.1f} tokens/s (median of {len(seconds[name])} calls; "
              f"{generated / max(seconds[name]):.1f}-{generated / min(seconds[name]):.1f})")
    for name, what in [("feedback", "goal >= 0.95"), ("feedback, 1 prefill pass", "FUSED's second prefill pass left out")]:
        pairs = paired_ratios(seconds, name)
        print(f"vLLM {name} / vLLM standard: {tps[name] / tps['standard']:.3f} of the medians, "
              f"{statistics.median(pairs):.3f} per round [{min(pairs):.3f}-{max(pairs):.3f}]  ({what})")
    if args.sessions > 1:
        print(f"per round, each session's median ({args.sessions} sessions of {args.rounds} rounds, fresh engines each): "
              + "; ".join(f"{name} " + " ".join(f"{statistics.median(paired_ratios(s, name)):.3f}" for s in sessions)
                          for name in ("feedback", "feedback, 1 prefill pass")))
    print(f"vLLM feedback / fbt generate (feedback, FUSED): {tps['feedback'] / tps['fbt generate']:.2f}")


if __name__ == "__main__":
    main()
