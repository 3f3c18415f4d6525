"""Data efficiency (paper: a standard model needs ~1.5-2x the tokens of an FBT model at 1B).

    python tools/data_efficiency.py [--seeds 1,2,3] [--steps 600] [--jobs 1] [--reuse] [--out docs/results]
                                    [--render-only]

Trains the tiny recipe on the embedded token mix as a standard model (feedback.fusion=off), as an
FBT model (the recipe as is: single-pass until 60%, then 75/22/3) and as the ``first_input=state``
ablation (pass 1 fuses h_init instead of reading the embeddings), each for every seed, and records the
held-out validation loss every 50 steps (FBT at its feedback depth, 3 passes, and at 1 pass).
Same compute budget: the FBT run's extra passes cost FLOPs (k passes = k x forward and backward with
grad_mode all), so the standard model gets the steps that spend the FBT run's FLOPs (about 1.11x
the steps at the default schedule) with the same LR schedule shape. Reports the token ratio at which
the standard model reaches the FBT model's final loss (interpolated on its curve; "not reached" if it
never does within its budget). Writes docs/results/data_efficiency.{md,json,png}; ``--render-only``
writes the page again from the recorded JSON (the page's answers are computed from its numbers, the
per-seed summary is the one recorded). ``--jobs 2`` runs two at a time with one thread each.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


EVERY = 50
KINDS = ("fbt", "state", "standard")  # FBT (pass 1 = the plain model), the first_input=state ablation, standard


def fbt_compute_factor(steps: int, feedback_start: int, mix: list[float]) -> float:
    """FBT FLOPs over a standard run of the same steps (k passes cost k x a 1-pass step)."""
    expected_k = sum((i + 1) * p for i, p in enumerate(mix))
    return (feedback_start + (steps - feedback_start) * expected_k) / steps


def tokens_to_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """First token count at which a (tokens, loss) curve reaches ``target`` (linear interpolation)."""
    for (t0, l0), (t1, l1) in zip(curve[:-1], curve[1:]):
        if l0 > target >= l1:
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    if curve and curve[0][1] <= target:
        return curve[0][0]
    return None


def run(seeds: list[int], steps: int, runs: Path, jobs: int = 1, reuse: bool = False) -> dict:
    import yaml

    from fbt_megatron.research.runs import ROOT, finished_run, run_jobs, train_run

    tiny = yaml.safe_load((ROOT / "recipes/tiny.yaml").read_text())
    start, mix = tiny["schedule"]["feedback_start_step"] * steps // tiny["train"]["steps"], tiny["schedule"]["mix"]
    factor = fbt_compute_factor(steps, start, mix)
    std_steps = round(steps * factor)
    out = {kind: [] for kind in KINDS}
    out.update(compute_factor=factor, standard_steps=std_steps, feedback_start_step=start)
    common = ["eval.every=%d" % EVERY, "checkpoint.every=100000", "checkpoint.at_end=false", "logging.tensorboard=false"]
    fbt = [f"schedule.feedback_start_step={start}", "eval.feedback_passes=3"]
    kinds = {"fbt": (fbt, steps),
             # the ablation: the earlier reading (pass 1 fuses h_init, normal-initialised fusion)
             "state": (fbt + ["feedback.first_input=state", "feedback.value_init=normal", "feedback.gate_init=normal"],
                       steps),
             "standard": (["feedback.fusion=off", f"schedule.feedback_start_step={std_steps}"], std_steps)}

    def one(seed, kind):
        extra, n = kinds[kind]
        s = finished_run(runs / f"{kind}_seed{seed}") if reuse else None
        if s is not None:  # a finished run with these arguments: summarise it again
            return {"seed": seed, "val_history": s["val_history"], "pass_counts": s["pass_counts"], "reused": True,
                    **({"note": s["note"]} if "note" in s else {})}
        print(f"[data_efficiency] {kind} seed {seed}: {n} steps", flush=True)
        s = train_run("recipes/tiny.yaml", runs / f"{kind}_seed{seed}",
                      [f"name=de_{kind}_{seed}", f"seed={seed}", f"schedule.seed={seed}", f"train.steps={n}",
                       *common, *extra], resume=reuse)  # a stopped run continues from its checkpoint
        return {"seed": seed, "val_history": s["val_history"], "pass_counts": s["pass_counts"]}

    todo = [(seed, kind) for seed in seeds for kind in KINDS]
    for (seed, kind), result in zip(todo, run_jobs(one, todo, jobs)):
        out[kind].append(result)
    return out


def summarise(results: dict) -> dict:
    import numpy as np

    def curve(run, passes):
        return [(v["tokens"], v["loss"][str(passes)] if str(passes) in v["loss"] else v["loss"][passes])
                for v in run["val_history"]]

    rows = []
    for fbt, state, std in zip(results["fbt"], results["state"], results["standard"]):
        fbt_curve, std_curve = curve(fbt, 3), curve(std, 1)
        fbt_final_tokens, fbt_final = fbt_curve[-1]
        reach = tokens_to_reach(std_curve, fbt_final)
        start = results["feedback_start_step"]
        before = [(a["step"], a["loss"]["1"], b["loss"]["1"]) for a, b in zip(fbt["val_history"], std["val_history"])
                  if a["step"] <= start]
        rows.append({"seed": fbt["seed"], "fbt_final": fbt_final, "fbt_final_1pass": curve(fbt, 1)[-1][1],
                     "state_final": curve(state, 3)[-1][1], "state_final_1pass": curve(state, 1)[-1][1],
                     "standard_final": std_curve[-1][1],
                     "standard_at_fbt_tokens": float(np.interp(fbt_final_tokens, *zip(*std_curve))),
                     "tokens_ratio": None if reach is None else reach / fbt_final_tokens,
                     "max_gap_before_switch": max(abs(x - y) for _, x, y in before)})
    return {"rows": rows}


KIND_LABELS = {"fbt": "FBT", "state": "state", "standard": "standard"}
PAPER_RATIO = "1.5–2 at 1 B"  # the paper's token ratio
TRACKS = 0.1  # largest |FBT 1-pass - standard| validation loss before the switch that still counts as tracking


def reuse_note(results: dict) -> str:
    """Which runs were trained by this invocation and which were found finished (``--reuse``), one line per note."""
    runs = [(kind, r) for kind in KINDS for r in results[kind]]
    reused = [(kind, r) for kind, r in runs if r.get("reused")]
    if not reused:
        return ""
    by_note: dict[str, dict[str, list]] = {}
    for kind, r in reused:
        by_note.setdefault(r.get("note", ""), {}).setdefault(kind, []).append(r["seed"])
    lines = [f"{len(reused)} of {len(runs)} runs were trained by earlier invocations and summarised again here "
             "(`--reuse`; the time below leaves them out)."]
    for note, kinds in by_note.items():
        who = " and ".join(f"{KIND_LABELS[k]} seed{'s' if len(s) > 1 else ''} {', '.join(map(str, s))}"
                           for k, s in kinds.items())
        lines.append(f"{who[0].upper()}{who[1:]}: {note or 'found finished under --runs'}.")
    return "\n".join(lines)


def answers(summary: dict) -> list[list[str]]:
    """The page's opening rows, from the recorded per-seed summary. FBT needs fewer tokens in a seed when the
    standard model needs more than FBT's tokens to reach FBT's final loss (token ratio > 1, or never reaches it);
    FBT tracks the standard model when the largest 1-pass gap before the switch is under ``TRACKS`` in every seed."""
    from fbt_megatron.research.report import fmt, mean_std

    rows = summary["rows"]
    ratios = [x["tokens_ratio"] for x in rows]
    reached = [x for x in ratios if x is not None]
    fewer = sum(1 for x in ratios if x is None or x > 1.0)
    gaps = [x["max_gap_before_switch"] for x in rows]
    apart = sum(1 for g in gaps if g >= TRACKS)
    unreached = len(ratios) - len(reached)
    return [
        ["Does FBT need fewer tokens than a standard model of the same compute?",
         "Yes" if fewer == len(rows) else "No, at this size" if fewer == 0 else f"In {fewer} of {len(rows)} seeds",
         (f"the standard model needs {fmt(*mean_std(reached), 2)} of FBT's tokens to reach FBT's final loss"
          if reached else "the standard model never reaches FBT's final loss")
         + (f" ({unreached} of {len(rows)} seeds never reach it)" if reached and unreached else ""),
         "–" if fewer == len(rows) else
         "larger models, more feedback steps ([feedback_phase.md](feedback_phase.md))" if fewer == 0 else "more seeds"],
        ["Does FBT track the standard model before the switch?",
         "Yes" if apart == 0 else f"No ({apart} of {len(rows)} seeds)",
         f"largest gap in 1-pass loss before the switch: {fmt(*mean_std(gaps), 3)} (under {TRACKS} in every seed "
         "counts as tracking)",
         "–" if apart == 0 else "a look at the runs' LR schedules and data order before the switch"],
    ]


def render(data: dict, out_dir: Path, figure_too: bool = True) -> Path:
    """``out_dir/data_efficiency.{md,json}`` (and the figure) from the recorded ``data``: args, results, the
    per-seed summary (as recorded, not computed again) and provenance."""
    from fbt_megatron.research.report import answers_table, fmt, mean_std, provenance_line, save, table

    args, results, summary = data["args"], data["results"], data["summary"]
    r = summary["rows"]
    ratios = [x["tokens_ratio"] for x in r]
    reached = [x for x in ratios if x is not None]
    table_rows = [[x["seed"], f"{x['fbt_final']:.4f}", f"{x['fbt_final_1pass']:.4f}", f"{x['state_final']:.4f}",
                   f"{x['standard_at_fbt_tokens']:.4f}", f"{x['standard_final']:.4f}",
                   "not reached" if x["tokens_ratio"] is None else f"{x['tokens_ratio']:.2f}",
                   f"{x['max_gap_before_switch']:.4f}"] for x in r]
    table_rows.append(["mean ± std", fmt(*mean_std([x["fbt_final"] for x in r]), 4),
                       fmt(*mean_std([x["fbt_final_1pass"] for x in r]), 4),
                       fmt(*mean_std([x["state_final"] for x in r]), 4),
                       fmt(*mean_std([x["standard_at_fbt_tokens"] for x in r]), 4),
                       fmt(*mean_std([x["standard_final"] for x in r]), 4),
                       f"{fmt(*mean_std(reached), 2)} ({len(reached)}/{len(ratios)} reached)",
                       fmt(*mean_std([x["max_gap_before_switch"] for x in r]), 4)])
    columns = [
        ["token ratio", "tokens the standard model needs to reach FBT's final loss, over FBT's tokens (> 1: FBT is "
                        f"more data-efficient; the paper reports {PAPER_RATIO})"],
        ["state ablation", "the earlier reading of the paper: pass 1 fuses h_init (`feedback.first_input=state`), "
                           "normal-initialised fusion; same steps as FBT"],
        ["gap before the switch", "the largest \\|FBT 1-pass − standard\\| validation loss at the same step up to "
                                  "the switch; the runs differ there only in the LR schedule's length"]]
    md = "\n".join([
        "# Data efficiency", "", answers_table(answers(summary), number=f"number ({len(r)} seeds)"), "",
        f"**Setting.** The tiny recipe: {args['steps']} FBT steps, feedback from step "
        f"{results['feedback_start_step']}, mix 75/22/3.",
        f"The standard model has the same size and the same compute: {results['standard_steps']} steps, "
        f"{results['compute_factor']:.3f} × FBT's FLOPs per step on average.",
        f"Validation runs every {EVERY} steps on held-out documents.", "",
        table(["column", "meaning"], columns), "",
        table(["seed", "FBT final (3-pass)", "FBT final (1-pass)", "state ablation final (3-pass)",
               "standard at FBT's tokens", "standard final (same compute)", "token ratio", "gap before the switch"],
              table_rows), "", "![data efficiency](data_efficiency.png)", "",
        provenance_line(data["provenance"])])
    return save(out_dir, "data_efficiency", md, data,
                draw=(lambda: _figure(results, args["steps"])) if figure_too else None)


def _figure(results: dict, steps: int):
    import numpy as np

    from fbt_megatron.research.report import figure

    fig, (ax,) = figure(ncols=1, width=6.0, height=4.0)
    for kind, passes, color in (("standard", 1, "C1"), ("fbt", 3, "C0"), ("fbt", 1, "C2"), ("state", 3, "C3")):
        curves = [[(v["tokens"], v["loss"][str(passes)]) for v in r["val_history"]] for r in results[kind]]
        n = min(len(c) for c in curves)
        tokens = np.array([t for t, _ in curves[0][:n]])
        losses = np.array([[l for _, l in c[:n]] for c in curves])
        m, s = losses.mean(0), losses.std(0, ddof=1) if len(curves) > 1 else np.zeros(n)
        label = {"standard": "standard", "fbt": f"FBT, {passes}-pass eval",
                 "state": "first_input=state ablation, 3-pass eval"}[kind]
        ax.plot(tokens, m, color=color, label=label)
        ax.fill_between(tokens, m - s, m + s, color=color, alpha=0.2)
    ax.axvline(results["feedback_start_step"] * (results["fbt"][0]["val_history"][-1]["tokens"] / max(steps, 1)),
               color="grey", lw=0.5, ls="--")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("held-out validation loss")
    ax.set_title("data efficiency (mean ± std over seeds)", fontsize=9)
    ax.legend(fontsize=8)
    return fig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (each with one CPU thread when > 1)")
    ap.add_argument("--runs", default="runs/research/data_efficiency")
    ap.add_argument("--reuse", action="store_true",
                    help="use finished runs found under --runs instead of retraining; continue stopped ones "
                         "from their checkpoints")
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--render-only", action="store_true", help="write the page again from --out's recorded JSON")
    a = ap.parse_args(argv)
    from fbt_megatron.research.report import check_report_files, provenance_record, render_again

    if a.render_only:
        print(render_again(render, Path(a.out), "data_efficiency").read_text())
        return 0
    check_report_files(Path(a.out), "data_efficiency")  # before the runs, not after them
    os.environ.setdefault("FBT_DEVICE", "cpu")
    t0 = time.perf_counter()
    results = run([int(s) for s in a.seeds.split(",")], a.steps, Path(a.runs), a.jobs, a.reuse)
    data = {"args": vars(a), "results": results, "summary": summarise(results),
            "provenance": provenance_record("python tools/data_efficiency.py", time.perf_counter() - t0,
                                            conditions=reuse_note(results))}
    print(render(data, Path(a.out)).read_text())
    return 0


if __name__ == "__main__":
    from fbt_megatron.research.report import run_tool

    sys.exit(run_tool(main, "data_efficiency"))
