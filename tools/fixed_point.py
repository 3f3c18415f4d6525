"""The fixed point (paper: only the model that saw 3-pass batches stays stable to k = 1000).

    python tools/fixed_point.py [--passes 1000] [--steps 600] [--out docs/results]

Trains the tiny recipe twice on the embedded token mix, identical except for the feedback mix:
{1,2} passes (78% / 22%) and the paper's 75% / 22% / 3% (feedback phase from step 120 of 600, so the
rare 3-pass batches occur at all in a run this short). For each model, on held-out sequences of the
longest length the model allows (its max_sequence_length), it runs k = 1..K passes and records the
relative residual ||h^{k+1} - h^k|| / ||h^k|| and the contraction ratio r_{k+1} / r_k, and at the
converged states the spectral norm (power method) and Frobenius norm (Hutchinson) of the one-step map
d h_t / d h_{t-1} at several positions. Jacobi is exact once k >= S (sequence length), so the residual
is 0 there whatever the weights: contraction shows as a falling residual and a ratio < 1 for k < S and
as a one-step spectral norm < 1. Writes docs/results/fixed_point.{md,json,png}; ``--render-only``
writes the page again from the recorded JSON (the page's answers are computed from its numbers).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


MIXES = {"mix_1_2": "[0.78,0.22]", "mix_1_2_3": "[0.75,0.22,0.03]"}
LABELS = {"mix_1_2_3": "75/22/3", "mix_1_2": "1/2 mix"}  # the paper's mix first
CONVERGED = 1e-3  # relative residual after 10 passes that counts as converged
POSITIONS = [8, 32, 64, 96, 120]


def train_models(runs: Path, steps: int, feedback_start: int) -> dict:
    from fbt_megatron.research.runs import finished_run, train_run

    out = {}
    for name, mix in MIXES.items():
        print(f"[fixed_point] training {name} ({steps} steps)", flush=True)
        out[name] = train_run("recipes/tiny.yaml", runs / name, [
            f"name=fixed_point_{name}", f"train.steps={steps}", f"schedule.feedback_start_step={feedback_start}",
            f"schedule.mix={mix}", "eval.every=100000", "checkpoint.every=100000", "logging.tensorboard=false"],
            resume=finished_run(runs / name) is None)  # a stopped run continues; a finished one trains afresh
    return out


def check_finished(runs: Path) -> None:
    """``--skip-training``: each mix's run folder must hold a finished run (a stopped or diverged one's
    checkpoint is not the model the page describes)."""
    from fbt_megatron.errors import UserError
    from fbt_megatron.research.runs import diverged_run, finished_run

    for name in MIXES:
        if reason := diverged_run(runs / name):
            raise UserError(f"--skip-training: the run in {runs / name} diverged ({reason}), so it has no model "
                            "to analyse; delete the folder and run without --skip-training to train it afresh")
        if finished_run(runs / name) is None:
            raise UserError(f"--skip-training: {runs / name} holds no finished run (none, or one stopped short of "
                            "its last step); run without --skip-training to train or continue it")


def analyse(runs: Path, passes: int, rows: int = 8) -> dict:
    import torch

    from fbt_megatron.research.fixed_point import iterate_passes, one_step_jacobian_norms
    from fbt_megatron.checkpoint.model import load_checkpoint_model
    from fbt_megatron.research.stability import contraction_ratios
    from fbt_megatron.data.loaders import build_valid_batches

    results = {}
    for name in MIXES:
        model, recipe, _ = load_checkpoint_model(runs / name)
        batches = build_valid_batches(recipe, 0, 1)
        ids = torch.cat([b["input_ids"] for b in batches])[:rows]
        it = iterate_passes(model, ids, passes)
        norms = one_step_jacobian_norms(model, ids, it["top"], [p for p in POSITIONS if p < ids.shape[1]])
        results[name] = {"seq_length": int(ids.shape[1]), "residuals": it["residuals"],
                         "contraction": contraction_ratios(it["residuals"]), "jacobian": norms}
        print(f"[fixed_point] {name}: residual k=2 {it['residuals'][0]:.3e}, "
              f"k=10 {it['residuals'][9]:.3e}; one-step sigma {[round(n['spectral_norm'], 3) for n in norms]}", flush=True)
    return results


def answers(results: dict) -> list[list[str]]:
    """The page's opening rows, from the recorded residuals and one-step norms."""
    names = [n for n in LABELS if n in results]
    r10 = {n: results[n]["residuals"][min(9, len(results[n]["residuals"]) - 1)] for n in names}
    sigma = {n: max(j["spectral_norm"] for j in results[n]["jacobian"]) for n in names}  # < 1 at every position
    converged = [n for n in names if r10[n] < CONVERGED]
    contracts = [n for n in names if sigma[n] < 1.0]

    def which(chosen):
        return ("Yes, both mixes" if len(names) == 2 else "Yes") if chosen == names else \
            "No" if not chosen else "Only " + ", ".join(LABELS[n] for n in chosen)

    return [
        ["Do the passes converge to the exact recurrence?", which(converged),
         "residual after 10 passes " + " and ".join(f"{r10[n]:.1e} ({LABELS[n]})" for n in names),
         "–" if converged == names else "more feedback training"],
        ["Is the one-step map a contraction?", "No, not yet" if not contracts else which(contracts),
         "largest one-step spectral norm over positions " + " and ".join(f"{sigma[n]:.2f} ({LABELS[n]})" for n in names)
         + "; a contraction has it < 1",
         "–" if contracts == names else "more feedback training (one seed per mix here)"],
    ]


def render(data: dict, out_dir: Path, figure_too: bool = True) -> Path:
    """``out_dir/fixed_point.{md,json}`` (and the figure) from the recorded ``data``: args, results, provenance."""
    import numpy as np

    from fbt_megatron.research.report import answers_table, figure, provenance_line, save, table

    args, results = data["args"], data["results"]
    rows = []
    for name, r in results.items():
        res, S = np.array(r["residuals"]), r["seq_length"]
        sig = [n["spectral_norm"] for n in r["jacobian"]]
        pre = [c for c in r["contraction"][: S // 2] if c is not None]
        rows.append([name, S, f"{res[0]:.2e}", f"{res[min(9, len(res) - 1)]:.2e}", f"{res[min(S // 2, len(res) - 1)]:.2e}",
                     f"{res[-1]:.1e}", f"{np.median(pre):.3f}" if pre else "n/a",
                     f"{np.mean(sig):.3f} (max {np.max(sig):.3f})",
                     f"{np.mean([n['frobenius_norm'] for n in r['jacobian']]):.3f}"])
    header = ["model", "S", "r(k=1)", "r(k=10)", "r(k=S/2)", f"r(k={args['passes'] - 1})", "median ratio k<S/2",
              "one-step sigma_max", "one-step ||J||_F"]
    md = "\n".join([
        "# The fixed point", "", answers_table(answers(results)), "",
        f"Tiny recipe, {args['steps']} steps, feedback phase from step {args['feedback_start']}; held-out sequences "
        "of the model's maximum length S; k = 1..%d passes (eval mode, no jitter). Jacobi reaches the exact "
        "recurrence at k = S, so residuals past S are 0 for any weights; contraction is read from k < S and from "
        "the one-step spectral norm of d h_t / d h_{t-1} at the converged states (< 1: errors shrink as they "
        "travel)." % args["passes"],
        "", table(header, rows), "", "![fixed point](fixed_point.png)", "",
        provenance_line(data["provenance"])])
    return save(out_dir, "fixed_point", md, data, draw=(lambda: _figure(results, figure)) if figure_too else None)


def _figure(results: dict, figure):
    import numpy as np

    fig, (ax_r, ax_c, ax_j) = figure(ncols=3, width=4.4)
    for name, r in results.items():
        res = np.array(r["residuals"])
        k = np.arange(1, len(res) + 1)
        ax_r.semilogy(k, np.maximum(res, 1e-12), label=name)
        ax_c.plot(k[:-1], [c if c is not None else np.nan for c in r["contraction"]], label=name)
        ax_j.plot([n["position"] for n in r["jacobian"]], [n["spectral_norm"] for n in r["jacobian"]], "o-",
                  label=name)
    for ax, title in ((ax_r, "relative residual"), (ax_c, "contraction ratio r(k+1)/r(k)"),
                      (ax_j, "one-step spectral norm by position")):
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    ax_r.set_xscale("log")
    ax_r.set_xlabel("passes k")
    ax_c.set_xscale("log")
    ax_c.set_xlabel("passes k")
    ax_c.axhline(1.0, color="grey", lw=0.5)
    ax_j.axhline(1.0, color="grey", lw=0.5)
    ax_j.set_xlabel("position t")
    return fig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--feedback-start", type=int, default=120)
    ap.add_argument("--runs", default="runs/research/fixed_point")
    ap.add_argument("--skip-training", action="store_true", help="analyse existing runs")
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--render-only", action="store_true", help="write the page again from --out's recorded JSON")
    a = ap.parse_args(argv)
    from fbt_megatron.research.report import check_report_files, provenance_record, render_again

    if a.render_only:
        print(render_again(render, Path(a.out), "fixed_point").read_text())
        return 0
    check_report_files(Path(a.out), "fixed_point")  # before the runs, not after them
    os.environ.setdefault("FBT_DEVICE", "cpu")
    t0 = time.perf_counter()
    runs, out_dir = Path(a.runs), Path(a.out)
    if a.skip_training:
        check_finished(runs)
    else:
        train_models(runs, a.steps, a.feedback_start)
    from fbt_megatron import runtime

    runtime.init_distributed()
    try:
        results = analyse(runs, a.passes)
    finally:
        runtime.shutdown()
    data = {"args": vars(a), "results": results,
            "provenance": provenance_record("python tools/fixed_point.py", time.perf_counter() - t0)}
    print(render(data, out_dir).read_text())
    return 0


if __name__ == "__main__":
    from fbt_megatron.research.report import run_tool

    sys.exit(run_tool(main, "fixed_point"))
