"""Layer-0 probes (paper: near chance -> 99.6% / 100% after one feedback step).

    python tools/probe_layer0.py [--seeds 0,1,2] [--steps 600] [--out docs/results] [--render-only]

For each task (completion tracking, delayed memory) and seed: trains a tiny FBT model (glu fusion,
pass mix 50/30/20 from step 0; 2 layers, hidden 64, 64-token sequences) and a standard model of the
same size on the task, then fits linear probes (logistic regression, held-out sequences) for the
task's hidden variables on
- FBT layer 0: pass 1 (no feedback), after one feedback step, at the exact recurrence;
- controls: the fed-back state zeroed, shuffled across the batch, a randomly initialised FBT;
- the standard model: the input of every layer and its top state;
- shuffled labels on the FBT one-step features (must be at the majority baseline).
Writes docs/results/probes.{md,json,png}; ``--render-only`` writes the page again from the recorded
JSON (the page's answers are computed from its numbers).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


PROBES = {"completion": ["complete"], "delayed_memory": ["recall", "recall_prev"]}
TASK_KWARGS = {"completion": {"max_count": 4, "num_items": 8}, "delayed_memory": {"delay": 4, "num_symbols": 16}}
# the hidden variable each task's state must carry into layer 0 after one feedback step, as the answers name it
STATE_PROBES = {("completion", "complete"): "completion tracking",
                ("delayed_memory", "recall_prev"): "the previous answer"}
CARRIES = 0.05  # mean probe accuracy this far above the majority baseline counts as carrying the variable
PAPER_ACCURACY = 0.996  # the paper's layer-0 probe accuracy after one feedback step


def run(seeds: list[int], steps: int, eval_rows: int = 96) -> dict:
    import numpy as np
    import torch

    from fbt_megatron.research.probes import (ToySetup, build_toy_model, fit_probe, layer_inputs, make_batch,
                                              majority_baseline, train_toy_model)

    results = {}
    for task, probe_names in PROBES.items():
        setup = ToySetup(task=task, steps=steps, task_kwargs=TASK_KWARGS[task])
        per = results.setdefault(task, {"probes": {}, "train_loss": {}})
        for seed in seeds:
            batch = make_batch(setup, np.random.default_rng(10_000 + seed), batch=eval_rows)
            ids = torch.from_numpy(batch.input_ids)
            rows = np.random.default_rng(seed).permutation(eval_rows)
            train_rows, test_rows = rows[: eval_rows * 3 // 4], rows[eval_rows * 3 // 4 :]
            feats = {}
            for fusion, tag in (("glu", "fbt"), ("off", "standard")):
                model, losses = train_toy_model(setup, fusion, seed)
                per["train_loss"].setdefault(tag, []).append(float(np.mean(losses[-50:])))
                feats.update({f"{tag}/{k}": v.numpy() for k, v in layer_inputs(model, ids).items()})
            random_fbt = build_toy_model(setup, "glu", seed + 777, batch.vocab_size).eval()
            feats["fbt_random_init/layer0_feedback1"] = layer_inputs(random_fbt, ids)["layer0_feedback1"].numpy()
            for name in probe_names:
                labels = batch.probes[name]
                out = per["probes"].setdefault(name, {})
                out.setdefault("majority_baseline", []).append(majority_baseline(labels, train_rows, test_rows))
                for key, x in feats.items():
                    out.setdefault(key, []).append(fit_probe(x, labels, train_rows, test_rows, seed))
                shuffled = labels.copy().reshape(-1)
                np.random.default_rng(seed).shuffle(shuffled)
                out.setdefault("shuffled_labels/fbt/layer0_feedback1", []).append(
                    fit_probe(feats["fbt/layer0_feedback1"], shuffled.reshape(labels.shape), train_rows, test_rows, seed))
            print(f"[probe] {task} seed {seed} done", flush=True)
    return results


ROW_ORDER = ["majority_baseline", "fbt/layer0_pass1", "fbt/layer0_feedback1", "fbt/layer0_exact",
             "fbt/layer0_feedback1_zeroed", "fbt/layer0_feedback1_shuffled", "fbt_random_init/layer0_feedback1",
             "shuffled_labels/fbt/layer0_feedback1"]


def answers(results: dict, seeds) -> list[list[str]]:
    """The page's opening rows, from the recorded probe accuracies. A row of features carries a variable when
    its mean accuracy is at least ``CARRIES`` above the majority baseline's mean."""
    from fbt_megatron.research.report import fmt, mean_std

    probes = {label: results[task]["probes"][name] for (task, name), label in STATE_PROBES.items()
              if task in results and name in results[task]["probes"]}

    def mean(by_key, key):
        return mean_std(by_key[key])[0]

    def carries(by_key, key):
        return mean(by_key, key) >= mean(by_key, "majority_baseline") + CARRIES

    def which(chosen):
        return "Yes" if chosen == list(probes) else "No" if not chosen else "Only " + ", ".join(chosen)

    one_step = [label for label, by_key in probes.items() if carries(by_key, "fbt/layer0_feedback1")]
    controls = ("fbt/layer0_feedback1_zeroed", "fbt/layer0_feedback1_shuffled")
    leaks = [label for label in one_step if any(carries(probes[label], c) for c in controls)]
    pass1 = [label for label in probes if carries(probes[label], "fbt/layer0_pass1")]
    lowest = min((mean(by_key, "fbt/layer0_feedback1") for by_key in probes.values()), default=float("nan"))
    same_direction = one_step == list(probes) and not pass1
    return [
        ["Does one feedback step put the state into layer 0?", which(one_step),
         "; ".join(f"{label} {mean(by_key, 'majority_baseline'):.3f}" + (" (majority)" if i == 0 else "")
                   + f" → {fmt(*mean_std(by_key['fbt/layer0_feedback1']))}"
                   for i, (label, by_key) in enumerate(probes.items())) + f" ({len(seeds)} seeds)",
         "–" if one_step == list(probes) else "more training steps"],
        ["Is it the fed-back state that carries it?",
         "n/a (nothing carried)" if not one_step else "No" if leaks else "Yes",
         ("zeroed or shuffled states still carry " + ", ".join(leaks) if leaks else
          "zeroed or shuffled states fall back to the majority baseline") + " (zeroed / shuffled: "
         + "; ".join(f"{label} {' / '.join(f'{mean(probes[label], c):.3f}' for c in controls)}" for label in probes)
         + ")",
         "look for a path around the fed-back state" if leaks else "–"],
        ["How does the paper compare?",
         ("Same direction and size" if lowest >= PAPER_ACCURACY else "Same direction") if same_direction
         else "Not reproduced here",
         f"the paper: near chance → {100 * PAPER_ACCURACY:.1f} %; here "
         + " and ".join(f"{100 * mean(by_key, 'fbt/layer0_feedback1'):.1f} %" for by_key in probes.values()),
         "–" if same_direction and lowest >= PAPER_ACCURACY else "larger models"],
    ]


def render(data: dict, out_dir: Path, figure_too: bool = True) -> Path:
    """``out_dir/probes.{md,json}`` (and the figure) from the recorded ``data``: seeds, steps, results, provenance."""
    from fbt_megatron.research.report import answers_table, fmt, mean_std, provenance_line, save, table

    seeds, steps, results = data["seeds"], data["steps"], data["results"]
    lines = ["# Layer-0 probes", "", answers_table(answers(results, seeds)), "",
             "Linear-probe accuracy on held-out sequences (mean ± std over seeds "
             f"{','.join(map(str, seeds))}; {steps} training steps per model). "
             "`fbt/layer0_feedback1` is the input of layer 0 after one feedback step (pass 2 of teacher "
             "forcing); `layer0_pass1` the same model's layer-0 input without feedback; `layer0_exact` at the "
             "exact recurrence. Standard-model rows are the inputs of each layer of a model without feedback.",
             ""]
    for task, per in results.items():
        for name, by_key in per["probes"].items():
            rows = [[k, fmt(*mean_std(by_key[k]))] for k in _row_keys(by_key)]
            lines += [f"## {task}: `{name}`", "", table(["features", "accuracy"], rows), ""]
        losses = {k: fmt(*mean_std(v)) for k, v in per["train_loss"].items()}
        lines += [f"Final training loss ({task}): " + ", ".join(f"{k} {v}" for k, v in losses.items()), ""]
    lines += ["![probes](probes.png)", "", provenance_line(data["provenance"])]
    return save(out_dir, "probes", "\n".join(lines), data, draw=(lambda: _figure(results)) if figure_too else None)


def _row_keys(by_key: dict) -> list[str]:
    return [k for k in ROW_ORDER if k in by_key] + sorted(k for k in by_key if k.startswith("standard/"))


def _figure(results: dict):
    from fbt_megatron.research.report import figure, mean_std

    fig, axes = figure(ncols=sum(len(v["probes"]) for v in results.values()), width=4.2, height=4.2)
    ax_i = 0
    for task, per in results.items():
        for name, by_key in per["probes"].items():
            keys = _row_keys(by_key)
            ax = axes[ax_i]
            ax_i += 1
            means = [mean_std(by_key[k])[0] for k in keys]
            errs = [mean_std(by_key[k])[1] for k in keys]
            ax.barh(range(len(keys)), means, xerr=errs, color=["grey"] + ["C0"] * (len(keys) - 1))
            ax.set_yticks(range(len(keys)), [k.replace("/", "\n", 1) for k in keys], fontsize=6)
            ax.invert_yaxis()
            ax.set_xlim(0, 1)
            ax.set_title(f"{task}: {name}", fontsize=9)
            ax.set_xlabel("probe accuracy")
    return fig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--render-only", action="store_true", help="write the page again from --out's recorded JSON")
    a = ap.parse_args(argv)
    from fbt_megatron.research.report import check_report_files, provenance_record, render_again

    if a.render_only:
        print(render_again(render, Path(a.out), "probes").read_text())
        return 0
    check_report_files(Path(a.out), "probes")  # before the runs, not after them
    os.environ.setdefault("FBT_DEVICE", "cpu")
    from fbt_megatron import runtime

    seeds = [int(s) for s in a.seeds.split(",")]
    t0 = time.perf_counter()
    runtime.init_distributed()
    runtime.init_parallel_state(runtime.ParallelLayout(), seed=0)
    try:
        results = run(seeds, a.steps)
    finally:
        runtime.shutdown()
    data = {"seeds": seeds, "steps": a.steps, "results": results,
            "provenance": provenance_record("python tools/probe_layer0.py", time.perf_counter() - t0)}
    print(render(data, Path(a.out)).read_text())
    return 0


if __name__ == "__main__":
    from fbt_megatron.research.report import run_tool

    sys.exit(run_tool(main, "probe_layer0"))
