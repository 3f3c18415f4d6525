"""FUSED prefill (paper: two fused prefill passes recover most of feedback's gain on reasoning tasks).

    python tools/fused_prefill.py [RUN_DIR] [--problems 100] [--out docs/results]

On held-out math problems generated like the embedded mix's (a different seed from the training
documents), for a trained run (default ``runs/tiny``, the main job's output) and each decoding mode:
standard decoding (no feedback), and latent-feedback decoding with the prompt prefilled by K = 1, 2
(FUSED), 3 parallel passes or exactly (token by token). Reports the answer's mean negative
log-likelihood per token (the continuation scored as generation decodes it), greedy exact-match
accuracy on the ``#### answer`` line and the median generated length. Writes
docs/results/fused_prefill.{md,json}. Budget: about 5 minutes on 2 idle CPU cores for 100 problems.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = [("standard", 1), ("feedback", 1), ("feedback", 2), ("feedback", 3), ("feedback", "exact")]
ANSWER = re.compile(r"#### (-?[0-9.,]+)")
HELD_OUT_SEED = 1_000_003  # the embedded mix's math documents use seed 0


def held_out_problems(n: int, train_docs: int = 20_000) -> list[tuple[str, str]]:
    """(prompt, worked answer) pairs, 'Question: ...\nAnswer:' and ' ...\n#### value', generated with a
    different seed from the embedded mix's math documents (its defaults: 20,000 documents, seed 0), minus
    any question that also occurs there (small number ranges repeat)."""
    from data_pipeline.embedded import math_documents

    def questions(docs):
        for _, doc in docs:
            for part in doc.split("\n\n"):
                yield part.split("\nAnswer: ", 1)

    seen = {q for q, _ in questions(math_documents(train_docs, 0))}
    out = []
    for q, a in questions(math_documents(4 * n, HELD_OUT_SEED)):
        if q not in seen and len(out) < n:
            seen.add(q)
            out.append((f"{q}\nAnswer:", f" {a}"))
    return out


def final_answer(text: str) -> str | None:
    m = ANSWER.search(text)
    return m.group(1).replace(",", "").rstrip(".") if m else None


def run(run_dir: str, problems: list[tuple[str, str]], batch: int, max_new_tokens: int) -> list[dict]:
    from fbt_megatron.generate.api import TextGenerator
    from fbt_megatron.generate.loading import load_for_inference
    from fbt_megatron.generate.sampling import SamplingParams

    loaded = load_for_inference(run_dir)
    params = SamplingParams(max_new_tokens=max_new_tokens, stop=["\n\n", "Question:"])
    rows = []
    for mode, k in MODES:
        gen = TextGenerator(loaded, mode=mode, prefill_passes=k)
        nll, n_tok, correct, lengths = 0.0, 0, 0, []
        for i in range(0, len(problems), batch):
            chunk = problems[i : i + batch]
            contexts = [gen.encode(p) for p, _ in chunk]
            answers = [gen.encode(a) for _, a in chunk]
            for (ll, _), ans in zip(gen.decoder.score(contexts, answers), answers):
                nll -= ll
                n_tok += len(ans)
            for (_, ref), c in zip(chunk, gen.generate([p for p, _ in chunk], params)):
                correct += int(final_answer(c.text) is not None and final_answer(c.text) == final_answer(ref))
                lengths.append(len(c.tokens))
        rows.append({"mode": mode, "prefill_passes": k, "answer_nll": nll / max(n_tok, 1),
                     "exact_match": correct / len(problems), "median_generated_tokens": statistics.median(lengths)})
        print(f"[fused] {mode} K={k}: nll {rows[-1]['answer_nll']:.4f} exact {rows[-1]['exact_match']:.3f} "
              f"median len {rows[-1]['median_generated_tokens']}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", nargs="?", default="runs/tiny")
    ap.add_argument("--problems", type=int, default=100)
    ap.add_argument("--batch", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="docs/results")
    a = ap.parse_args(argv)
    os.environ.setdefault("FBT_DEVICE", "cpu")
    from fbt_megatron import runtime
    from fbt_megatron.checkpoint import resolve_checkpoint
    from fbt_megatron.research.report import provenance, save, table

    t0 = time.perf_counter()
    runtime.init_distributed()
    try:
        rows = run(a.run_dir, held_out_problems(a.problems), a.batch, a.max_new_tokens)
    finally:
        runtime.shutdown()
    ckpt = resolve_checkpoint(a.run_dir)
    md = "\n".join([
        "# FUSED prefill", "",
        f"Checkpoint `{ckpt}`; {a.problems} held-out math problems (generated like the embedded mix's, seed "
        f"{HELD_OUT_SEED}); greedy decoding, at most {a.max_new_tokens} new tokens, stop at a blank line. "
        "*Answer NLL*: mean negative log-likelihood per answer token, the answer fed as generation decodes it. "
        "*Exact match*: the `#### value` line equals the reference's.", "",
        table(["decoding", "prefill passes", "answer NLL", "exact match", "median generated tokens"],
              [[r["mode"], r["prefill_passes"], f"{r['answer_nll']:.4f}", f"{r['exact_match']:.3f}",
                r["median_generated_tokens"]] for r in rows]), "",
        provenance(f"python tools/fused_prefill.py {a.run_dir}", time.perf_counter() - t0)])
    out = save(Path(a.out), "fused_prefill", md, {"checkpoint": str(ckpt), "args": vars(a), "rows": rows})
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
