"""Instruction tuning at small scale: accuracy and reasoning length of base vs SFT models, standard vs
feedback vs FUSED decoding (paper: FUSED helps the instruction-tuned model; shorter reasoning on base
models, which instruction tuning erases).

    python tools/sft_math.py conversations --out data/math_chat.jsonl     # the math docs as conversations
    python tools/sft_math.py run [--seeds 1,2,3] [--out docs/results]     # the whole experiment

``run``, per seed: pretrain the tiny FBT recipe (``--pretrain-steps``, feedback from 60% of them) and a
standard model (fusion off) given the same compute (steps x the FBT run's mean passes per step); turn
the embedded math documents (``Question ... Answer ... #### N``, the ones pretraining saw) into one-turn
conversations, ``fbt data prepare --format chat`` them; SFT both models (``--sft-steps``; FBT with the
75/22/3 mix from step 0, the standard model again given equal compute); then on held-out problems
(another seed, never in training) measure greedy exact match on ``#### N`` and the median / mean
generated tokens in standard / feedback / FUSED decoding (standard models: standard only), base models
prompted ``Question: q\\nAnswer:``, SFT models through the chat template; per-problem pairing of
feedback/FUSED with standard decoding. Writes docs/results/sft.{md,json,png}.

Budget: about 40 minutes on 2 idle CPU cores with the defaults (3 seeds; each seed ~3 + 3.3 min of
pretraining, ~2 x 1.5 min of SFT, ~2 min of decoding). ``--pretrain-steps``/``--sft-steps``/
``--problems`` scale it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FEEDBACK_MIX = [0.75, 0.22, 0.03]


def _env() -> dict:
    return dict(os.environ, FBT_DEVICE=os.environ.get("FBT_DEVICE", "cpu"))


def prepare_chat(work: Path, tokenizer: str, max_tokens: int) -> Path:
    from fbt_megatron.research.sft import write_conversations

    jsonl, out = work / "math_chat.jsonl", work / "math_chat"
    n = write_conversations(jsonl)
    if not (out / "index.json").is_file():
        cmd = [sys.executable, "-m", "fbt_megatron.cli", "-q", "data", "prepare", "--format", "chat", "--input",
               str(jsonl), "--tokenizer", tokenizer, "--out", str(out), "--max-tokens", str(max_tokens), "--quiet"]
        r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {r.stderr}")
        print(f"[sft] {n} conversations -> {out}: {r.stdout.strip()}", flush=True)
    return out


def runs_for_seed(seed: int, a, work: Path, chat_dir: Path) -> dict:
    """The four runs of one seed; returns their run dirs."""
    from fbt_megatron.research.runs import train_run
    from fbt_megatron.research.sft import expected_passes

    P, S = a.pretrain_steps, a.sft_steps
    start = int(0.6 * P)
    fbt_pre = (start + (P - start) * expected_passes(FEEDBACK_MIX)) / P  # mean passes per pretraining step
    fbt_sft = expected_passes(FEEDBACK_MIX)
    d = {k: work / f"seed{seed}" / k for k in ("fbt_base", "std_base", "fbt_sft", "std_sft")}
    common = [f"seed={seed}", "eval.every=100000", "eval.at_end=false", "logging.tensorboard=false", "logging.log_every=50"]
    pre = [*common, "checkpoint.every=100000", "checkpoint.keep_last=1"]
    sft = [*common, "checkpoint.every=100000", "checkpoint.keep_last=1", f"data.pipeline.sources=[{{name: math_chat, path: {chat_dir}, weight: 1.0}}]",
           "data.pipeline.tokenizer=data/embedded/tokenizer.model", f"lr_schedule.warmup_steps={max(1, S // 20)}"]
    jobs = [
        ("fbt_base", "recipes/tiny.yaml", [*pre, f"train.steps={P}", f"schedule.feedback_start_step={start}"]),
        ("std_base", "recipes/tiny.yaml", [*pre, f"train.steps={round(P * fbt_pre)}", "feedback.fusion=off",
                                           "schedule.feedback_start_step=0", "schedule.mix=[1.0]"]),
        ("fbt_sft", "recipes/tiny_sft.yaml", [*sft, f"train.steps={S}", f"init_from={d['fbt_base']}"]),
        ("std_sft", "recipes/tiny_sft.yaml", [*sft, f"train.steps={round(S * fbt_sft)}", f"init_from={d['std_base']}",
                                              "schedule.mix=[1.0]"]),
    ]
    for name, recipe, overrides in jobs:
        if (d[name] / "summary.json").is_file() and not a.force:
            continue
        t0 = time.perf_counter()
        s = train_run(recipe, d[name], overrides)
        print(f"[sft] seed {seed} {name}: {s['step']} steps in {time.perf_counter() - t0:.0f}s, "
              f"val loss 1 pass {s.get('val_loss_1pass')}", flush=True)
    return {k: str(v) for k, v in d.items()}


def measure_all(dirs: dict, problems, a) -> dict:
    from fbt_megatron import runtime
    from fbt_megatron.research.sft import measure

    out = {}
    runtime.init_distributed()
    try:
        for name, run in dirs.items():
            out[name] = measure(run, problems, chat=name.endswith("_sft"), max_new_tokens=a.max_new_tokens)
            print(f"[sft] {name}: " + ", ".join(f"{m} EM {r['exact_match']:.3f} median {r['median_tokens']}"
                                                for m, r in out[name].items()), flush=True)
    finally:
        runtime.shutdown()
    return out


def summarise(per_seed: list[dict]) -> list[dict]:
    from fbt_megatron.research.report import mean_std
    from fbt_megatron.research.sft import paired_lengths

    rows = []
    for model in ("fbt_base", "fbt_sft", "std_base", "std_sft"):
        for mode in ("standard", "feedback", "fused"):
            got = [s[model][mode] for s in per_seed if mode in s[model]]
            if not got:
                continue
            em, med, mean = (mean_std([g[k] for g in got]) for k in ("exact_match", "median_tokens", "mean_tokens"))
            row = {"model": model, "mode": mode, "seeds": len(got), "exact_match": em, "median_tokens": med,
                   "mean_tokens": mean}
            if mode != "standard":
                pairs = [paired_lengths(s[model]["standard"]["tokens"], s[model][mode]["tokens"]) for s in per_seed]
                row["paired_mean_diff"] = mean_std([p["mean_diff"] for p in pairs])
                row["paired_shorter_longer"] = [sum(p["shorter"] for p in pairs), sum(p["longer"] for p in pairs)]
            rows.append(row)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    from fbt_megatron.research.report import figure

    fig, (ax1, ax2) = figure(2, width=5.5)
    labels = [f"{r['model']}\n{r['mode']}" for r in rows]
    colors = {"standard": "0.6", "feedback": "C0", "fused": "C1"}
    x = range(len(rows))
    ax1.bar(x, [r["exact_match"][0] for r in rows], yerr=[r["exact_match"][1] for r in rows], capsize=3,
            color=[colors[r["mode"]] for r in rows])
    ax1.set_ylabel("exact match (held-out math)")
    ax2.bar(x, [r["median_tokens"][0] for r in rows], yerr=[r["median_tokens"][1] for r in rows], capsize=3,
            color=[colors[r["mode"]] for r in rows])
    ax2.set_ylabel("median generated tokens")
    for ax in (ax1, ax2):
        ax.set_xticks(list(x), labels, rotation=60, fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# the arguments of ``run`` that change the numbers (the rest: where files go)
RESULT_ARGS = ("seeds", "pretrain_steps", "sft_steps", "problems", "max_new_tokens", "max_tokens")


def run_command(a) -> str:
    """The ``run`` command line that reproduces ``a``'s results (every argument of RESULT_ARGS)."""
    return "python tools/sft_math.py run " + " ".join(f"--{k.replace('_', '-')} {getattr(a, k)}" for k in RESULT_ARGS)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("conversations", help="write the embedded math problems as chat JSONL")
    c.add_argument("--out", default="data/math_chat.jsonl")
    c.add_argument("--docs", type=int, default=20_000, help="math documents (1-4 problems each)")
    r = sub.add_parser("run", help="the experiment (see above)")
    r.add_argument("--seeds", default="1,2,3")
    r.add_argument("--pretrain-steps", type=int, default=300)
    r.add_argument("--sft-steps", type=int, default=150)
    r.add_argument("--problems", type=int, default=100)
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--max-tokens", type=int, default=128, help="chat: longest conversation (the recipe's seq_length)")
    r.add_argument("--work", default="runs/sft_math")
    r.add_argument("--out", default="docs/results")
    r.add_argument("--force", action="store_true", help="train again runs that already finished")
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    os.environ.setdefault("FBT_DEVICE", "cpu")
    if a.cmd == "conversations":
        from fbt_megatron.research.sft import write_conversations

        print(f"{write_conversations(a.out, a.docs)} conversations -> {a.out}")
        return 0
    from data_pipeline.embedded import build_embedded
    from fbt_megatron.research.report import fmt, provenance, save, table
    from fbt_megatron.research.sft import held_out_problems

    t0 = time.perf_counter()
    os.chdir(ROOT)  # the recipes name data/embedded relative to the repository
    build_embedded("data/embedded", seq_length=128, progress=False, log=lambda m: print(f"[data] {m}", flush=True))
    work = Path(a.work).resolve()
    chat_dir = prepare_chat(work, "data/embedded/tokenizer.model", a.max_tokens)
    problems = held_out_problems(a.problems)
    per_seed = []
    for seed in [int(s) for s in a.seeds.split(",")]:
        dirs = runs_for_seed(seed, a, work, chat_dir)
        per_seed.append(measure_all(dirs, problems, a))
    rows = summarise(per_seed)
    plot(rows, Path(a.out) / "sft.png")
    f = lambda ms, d=3: fmt(ms[0], ms[1], d)  # noqa: E731
    md = "\n".join([
        "# Instruction tuning at small scale", "",
        f"Seeds {a.seeds}; tiny recipe pretrained {a.pretrain_steps} steps (FBT: feedback from step "
        f"{int(0.6 * a.pretrain_steps)}), SFT {a.sft_steps} steps on the embedded math problems as conversations "
        f"(loss on the assistant turn), FBT with the 75/22/3 mix from step 0; the standard model (fusion off) "
        f"gets the same compute (steps x FBT's mean passes per step). {a.problems} held-out problems, greedy, at most "
        f"{a.max_new_tokens} new tokens; base models prompted `Question: q\\nAnswer:`, SFT models through the chat "
        "template. Mean ± standard deviation over seeds.", "",
        table(["model", "decoding", "exact match", "median generated tokens", "mean generated tokens",
               "paired diff vs standard (tokens)", "shorter / longer (all seeds)"],
              [[r["model"], r["mode"], f(r["exact_match"]), f(r["median_tokens"], 1), f(r["mean_tokens"], 1),
                f(r["paired_mean_diff"], 2) if "paired_mean_diff" in r else "–",
                " / ".join(map(str, r["paired_shorter_longer"])) if "paired_shorter_longer" in r else "–"] for r in rows]),
        "", "![SFT](sft.png)", "",
        provenance(run_command(a), time.perf_counter() - t0)])
    out = save(Path(a.out), "sft", md, {"args": vars(a), "rows": rows, "per_seed": per_seed})
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
