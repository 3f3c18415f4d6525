"""FUSED prefill (paper: two fused prefill passes recover most of feedback's gain on reasoning tasks).

    python tools/fused_prefill.py [RUN_DIR] [--problems 100] [--out docs/results]

On held-out math problems generated like the embedded mix's (a different seed from the training
documents), for a trained run (default ``runs/tiny``, the main job's output) and each decoding mode:
standard decoding (no feedback), and latent-feedback decoding with the prompt prefilled by K = 1, 2
(FUSED), 3 parallel passes or exactly (token by token). Reports the answer's mean negative
log-likelihood per token (the continuation scored as generation decodes it), greedy exact-match
accuracy on the ``#### answer`` line and the median generated length, each mode paired per problem with
standard decoding. Writes docs/results/fused_prefill.{md,json,png}; ``--render-only`` writes the page
again from the recorded JSON (the page's answers are computed from its numbers).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path


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
        nll, n_tok, correct, lengths, per_problem = 0.0, 0, 0, [], []
        for i in range(0, len(problems), batch):
            chunk = problems[i : i + batch]
            contexts = [gen.encode(p) for p, _ in chunk]
            answers = [gen.encode(a) for _, a in chunk]
            for (ll, _), ans in zip(gen.decoder.score(contexts, answers), answers):
                nll -= ll
                n_tok += len(ans)
                per_problem.append(-ll / len(ans))
            for (_, ref), c in zip(chunk, gen.generate([p for p, _ in chunk], params)):
                correct += int(final_answer(c.text) is not None and final_answer(c.text) == final_answer(ref))
                lengths.append(len(c.tokens))
        # Error bar: the standard error over problems of the per-problem mean NLL (same problems in
        # every mode, so differences between modes are paired; their spread is reported too).
        sem = statistics.stdev(per_problem) / len(per_problem) ** 0.5 if len(per_problem) > 1 else 0.0
        rows.append({"mode": mode, "prefill_passes": k, "answer_nll": nll / max(n_tok, 1), "per_problem_nll": per_problem,
                     "per_problem_nll_mean": statistics.fmean(per_problem), "per_problem_nll_sem": sem,
                     "exact_match": correct / len(problems), "median_generated_tokens": statistics.median(lengths)})
        print(f"[fused] {mode} K={k}: nll {rows[-1]['answer_nll']:.4f} exact {rows[-1]['exact_match']:.3f} "
              f"median len {rows[-1]['median_generated_tokens']}", flush=True)
    return rows


Z = 2.0  # standard errors either side of a paired mean difference: its ~95 % interval over problems


def label(row: dict) -> str:
    """A decoding mode as the answers name it: FUSED is feedback decoding with 2 prefill passes."""
    if row["mode"] == "standard":
        return "standard"
    k = row["prefill_passes"]
    return "FUSED" if k == 2 else "exact" if k == "exact" else f"K={k}"


def answers(data: dict) -> list[list[str]]:
    """The page's opening rows, from the recorded per-problem answer NLLs. A mode beats another when the
    paired per-problem difference of their answer NLL, ± Z standard errors, lies below zero; it is worse
    when that interval lies above zero."""
    rows = data["rows"]
    fb = [r for r in rows if r["mode"] != "standard"]
    better = [r for r in fb if r["paired_diff_vs_standard"] + Z * r["paired_diff_sem"] < 0]
    worse = [r for r in fb if r["paired_diff_vs_standard"] - Z * r["paired_diff_sem"] > 0]
    lo = min(fb, key=lambda r: r["paired_diff_vs_standard"])
    hi = max(fb, key=lambda r: r["paired_diff_vs_standard"])
    side = " worse" if lo["paired_diff_vs_standard"] > 0 else " better" if hi["paired_diff_vs_standard"] < 0 else ""
    em = {r["exact_match"] for r in rows}
    em_text = (f"exact match {em.pop():g} everywhere" if len(em) == 1 else
               f"exact match {rows[0]['exact_match']:.2f} standard, "
               f"{min(r['exact_match'] for r in fb):.2f}–{max(r['exact_match'] for r in fb):.2f} feedback")
    if better:
        beat = "Yes" if len(better) == len(fb) else "Only " + ", ".join(label(r) for r in better)
        beat_change = "–"
    elif worse:
        beat, beat_change = "No", "a run whose fed-back mode is trained ([feedback_phase.md](feedback_phase.md))"
    else:
        beat, beat_change = "No difference within the error", "more problems"
    out = [[f"Does feedback decoding of the {Path(data['args']['run_dir']).name} run beat standard decoding on "
            "held-out math?", beat,
            f"answer NLL {lo['paired_diff_vs_standard']:+.2f} ({label(lo)}) to {hi['paired_diff_vs_standard']:+.2f} "
            f"({label(hi)}) ± {max(r['paired_diff_sem'] for r in fb):.2f} nats a token{side}; {em_text}",
            beat_change]]
    one = next((r for r in fb if r["prefill_passes"] == 1), None)
    fused = next((r for r in fb if r["prefill_passes"] == 2), None)
    if one and fused:
        d = [y - x for x, y in zip(one["per_problem_nll"], fused["per_problem_nll"])]
        mean = statistics.fmean(d)
        sem = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else 0.0
        within = mean - Z * sem <= 0 <= mean + Z * sem
        helps = ("No difference within the error" if within else
                 "Yes" if mean < 0 else "No, it is worse")
        out.append(["Does FUSED (2 prefill passes) help over 1 pass?", helps,
                    f"{fused['paired_diff_vs_standard']:+.3f} against {one['paired_diff_vs_standard']:+.3f} "
                    f"± {one['paired_diff_sem']:.3f}; paired FUSED − K=1 {mean:+.3f} ± {sem:.3f}",
                    "more problems" if within else "–"])
    return out


def render(data: dict, out_dir: Path, figure_too: bool = True) -> Path:
    """``out_dir/fused_prefill.{md,json}`` (and the figure) from the recorded ``data``: checkpoint, args,
    rows, provenance."""
    from fbt_megatron.research.report import answers_table, figure, provenance_line, save, table

    args, rows = data["args"], data["rows"]
    md = "\n".join([
        "# FUSED prefill", "", answers_table(answers(data)), "",
        f"Checkpoint `{data['checkpoint']}`; {args['problems']} held-out math problems (generated like the embedded "
        f"mix's, seed {HELD_OUT_SEED}); greedy decoding, at most {args['max_new_tokens']} new tokens, stop at a blank "
        "line. *Answer NLL*: mean negative log-likelihood per answer token, the answer fed as generation decodes it. "
        "*Exact match*: the `#### value` line equals the reference's.", "",
        "*Per-problem NLL*: mean over problems of each problem's per-token NLL, ± its standard error; "
        "*vs standard*: the paired per-problem difference from standard decoding, ± its standard error.", "",
        table(["decoding", "prefill passes", "answer NLL", "per-problem NLL", "vs standard", "exact match",
               "median generated tokens"],
              [[r["mode"], r["prefill_passes"], f"{r['answer_nll']:.4f}",
                f"{r['per_problem_nll_mean']:.3f} ± {r['per_problem_nll_sem']:.3f}",
                f"{r['paired_diff_vs_standard']:+.3f} ± {r['paired_diff_sem']:.3f}", f"{r['exact_match']:.3f}",
                r["median_generated_tokens"]] for r in rows]), "",
        "![FUSED prefill](fused_prefill.png)", "",
        provenance_line(data["provenance"])])
    return save(out_dir, "fused_prefill", md, data, draw=(lambda: _figure(rows, figure)) if figure_too else None)


def _figure(rows: list[dict], figure):
    """Per-problem answer NLL per decoding mode, with standard-error bars."""
    fig, (ax,) = figure(1)
    labels = ["standard" if r["mode"] == "standard" else f"feedback K={r['prefill_passes']}" for r in rows]
    ax.bar(range(len(rows)), [r["per_problem_nll_mean"] for r in rows],
           yerr=[r["per_problem_nll_sem"] for r in rows], capsize=4, color=["0.6"] + ["C0"] * (len(rows) - 1))
    ax.set_xticks(range(len(rows)), labels, rotation=20)
    ax.set_ylabel("answer NLL per token (held-out math)")
    lo = min(r["per_problem_nll_mean"] - 3 * r["per_problem_nll_sem"] for r in rows)
    ax.set_ylim(bottom=max(0.0, lo))
    return fig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", nargs="?", default="runs/tiny")
    ap.add_argument("--problems", type=int, default=100)
    ap.add_argument("--batch", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--render-only", action="store_true", help="write the page again from --out's recorded JSON")
    a = ap.parse_args(argv)
    from fbt_megatron.research.report import check_report_files, provenance_record, render_again

    if a.render_only:
        print(render_again(render, Path(a.out), "fused_prefill").read_text())
        return 0
    check_report_files(Path(a.out), "fused_prefill")  # before the runs, not after them
    os.environ.setdefault("FBT_DEVICE", "cpu")
    from fbt_megatron import runtime
    from fbt_megatron.checkpoint import resolve_checkpoint

    t0 = time.perf_counter()
    runtime.init_distributed()
    try:
        rows = run(a.run_dir, held_out_problems(a.problems), a.batch, a.max_new_tokens)
    finally:
        runtime.shutdown()
    ckpt = resolve_checkpoint(a.run_dir)
    base = rows[0]["per_problem_nll"]  # standard decoding: paired differences against it
    for r in rows:
        diffs = [x - y for x, y in zip(r["per_problem_nll"], base)]
        r["paired_diff_vs_standard"] = statistics.fmean(diffs)
        r["paired_diff_sem"] = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else 0.0
    data = {"checkpoint": str(ckpt), "args": vars(a), "rows": rows,
            "provenance": provenance_record(f"python tools/fused_prefill.py {a.run_dir}", time.perf_counter() - t0)}
    print(render(data, Path(a.out)).read_text())
    return 0


if __name__ == "__main__":
    from fbt_megatron.research.report import run_tool

    sys.exit(run_tool(main, "fused_prefill"))
