"""The feedback study's pieces (issue 40): the state-tracking task, the fusion's learning-rate
multiplier, validation at chosen pass counts, and the study command end to end at a toy size."""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fbt_megatron.config import SyntheticDataConfig
from fbt_megatron.data.synthetic import make_batch

ROOT = Path(__file__).resolve().parents[2]

# Student's t(0.975, df = 2) in closed form, (2p - 1) / sqrt(2 p (1 - p)) at p = 0.975
T_975_DF2 = 0.95 / (2 * 0.975 * 0.025) ** 0.5


def test_cyclic_task_labels_are_running_sums():
    cfg = SyntheticDataConfig(task="state_tracking", group="cyclic", group_size=7, vocab_size=7, seq_length=40)
    b = make_batch(cfg, range(5))
    x = b["input_ids"]
    assert x.shape == (5, 40) and 0 <= int(x.min()) and int(x.max()) < 7
    assert torch.equal(b["labels"], torch.cumsum(x, dim=1) % 7)
    assert b["loss_mask"].eq(1).all() and b["doc_start"][:, 0].all() and not b["doc_start"][:, 1:].any()
    assert torch.equal(b["position_ids"][0], torch.arange(40))
    assert not torch.equal(make_batch(cfg, [5])["input_ids"], x[:1])  # each index its own problem


def test_symmetric_task_labels_compose_permutations():
    """Element i is the i-th permutation of range(n) in lexicographic order; the label at t is
    x_t o x_{t-1} o ... o x_1 (apply x_1 first)."""
    cfg = SyntheticDataConfig(task="state_tracking", group="symmetric", group_size=3, vocab_size=6, seq_length=30)
    perms = list(itertools.permutations(range(3)))
    b = make_batch(cfg, range(4))
    for row, labels in zip(b["input_ids"].tolist(), b["labels"].tolist()):
        state = (0, 1, 2)
        for g, label in zip(row, labels):
            state = tuple(perms[g][state[i]] for i in range(3))  # (x_t o state)(i) = x_t(state(i))
            assert perms[label] == state
    assert len(set(b["labels"].flatten().tolist())) == 6  # the composed states cover the group


def test_state_task_must_fit_the_vocabulary():
    with pytest.raises(ValueError, match="symmetric group of size 4 has 24 elements, more than vocab_size=16"):
        SyntheticDataConfig(task="state_tracking", group="symmetric", group_size=4, vocab_size=16)


def test_fusion_lr_multiplier_scales_adams_step_of_the_fusion_only(single_process):
    """Adam's first step moves every entry by ~lr (m / sqrt(v) = +-1): the fusion's by lr x multiplier."""
    from fbt_megatron.config import FeedbackConfig, ModelConfig
    from fbt_megatron.engine.engine import Engine
    from fbt_megatron.engine.param_groups import param_groups
    from fbt_megatron.model.fbt_gpt import build_model

    model = build_model(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=64,
                                    max_sequence_length=16), FeedbackConfig())
    groups = param_groups(model, 0.0, False, fusion_decay_from=0, fusion_lr_multiplier=10.0)
    opt = torch.optim.AdamW(groups, lr=1.0, eps=1e-12)
    Engine.set_lr(SimpleNamespace(torch_optimizer=opt), 1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 64, (2, 16))
    model(ids, num_passes=2, labels=ids).token_loss.mean().backward()
    opt.step()
    for name, p in model.named_parameters():
        if p.grad is None or p.ndim < 2:
            continue
        step = (p.detach() - before[name]).abs()
        moved = step[p.grad.abs() > 1e-6]
        expected = 1e-2 if "feedback.value" in name or "feedback.gate" in name else 1e-3
        assert moved.numel() and torch.allclose(moved, torch.full_like(moved, expected), rtol=1e-3), name


def test_lr_sets_every_runs_peak_learning_rate_and_names_the_variant(monkeypatch):
    """--lr reaches the recipe of every run of every group (the recipe's own LR without it) and adds the
    LR-variant stabiliser runs; a variant's report and default runs folder are its own, a smoke study's too
    (--reuse reads both)."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    from feedback_study import LR_VARIANT_ABLATIONS, RECIPE, plan, study_name

    from fbt_megatron.recipe import load_recipe

    groups = ["main", "compute", "stabilisers", "state"]
    plain, tuned = plan(groups, "medium", False, 600), plan(groups, "medium", False, 600, 1e-3)
    assert set(tuned) - set(plain) == {f"fbt_heavy_{name}" for name in LR_VARIANT_ABLATIONS} != set()
    for name in tuned:
        if name in plain:
            assert load_recipe(ROOT / RECIPE, plain[name]).optimizer.lr == 3e-3
        assert load_recipe(ROOT / RECIPE, tuned[name]).optimizer.lr == 1e-3, name
    x50 = load_recipe(ROOT / RECIPE, plan(["stabilisers"], "medium", False, 1200, 6e-4)["fbt_heavy_untied_fusion_lr_x50"])
    x10 = load_recipe(ROOT / RECIPE, plan(["stabilisers"], "medium", False, 1200)["fbt_heavy_untied_fusion_lr_x10"])
    x30 = load_recipe(ROOT / RECIPE, plan(["stabilisers"], "tiny", False, 1200, 1e-3)["fbt_heavy_untied_fusion_lr_x30"])
    # the x50 run at 6e-4 and the x30 run at 1e-3 give the fusion the absolute LR of the x10 run at 3e-3
    assert x50.optimizer.lr * x50.optimizer.fusion_lr_multiplier == pytest.approx(3e-2)
    assert x30.optimizer.lr * x30.optimizer.fusion_lr_multiplier == pytest.approx(3e-2)
    assert x10.optimizer.lr * x10.optimizer.fusion_lr_multiplier == pytest.approx(3e-2)
    assert not x50.model.tie_embeddings and not x30.model.tie_embeddings
    names = {study_name("medium", steps, lr, smoke) for steps in (None, 1200) for lr in (None, 6e-4)
             for smoke in (False, True)}
    assert len(names) == 8 and study_name("medium", 1200, 6e-4, False) == "medium_1200_lr0.0006"


def test_recorded_read_outs_get_their_runs_layer_count(monkeypatch):
    """Read-outs recorded before they carried ``num_layers`` get the run's own (8 at the medium size, the
    research recipe's 4 at the tiny one); one that carries it keeps it."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    from feedback_study import add_layer_counts, plan

    readouts = {"state_fbt_heavy_seed1": {}, "state_standard_seed2": {"num_layers": 3}}
    add_layer_counts(readouts, plan(["state"], "medium", False, 1200))
    assert readouts == {"state_fbt_heavy_seed1": {"num_layers": 8}, "state_standard_seed2": {"num_layers": 3}}
    tiny = {"state_fbt_heavy_seed1": {}}
    add_layer_counts(tiny, plan(["state"], "tiny", False, 1200))
    assert tiny == {"state_fbt_heavy_seed1": {"num_layers": 4}}


def test_val_history_spans_invocations_and_keeps_a_steps_latest_line(tmp_path):
    """Validations only (not step lines, not other logged metrics), by step, the later of two lines for a
    step winning (a step validated again after a resume), a line cut by a kill skipped; run_summary puts
    them in place of summary.json's and leaves a run without a metrics file as it is."""
    from fbt_megatron.research.runs import run_summary
    from fbt_megatron.train.callbacks.metrics_file import read_val_history

    rows = [{"step": 1, "passes": 1, "loss": 9.0, "train/loss_k1": 9.0, "tokens_seen": 10},
            {"event": "metrics", "step": 2, "tokens_seen": 20, "val/loss_k1": 8.0, "val/loss_k2": 8.5},
            {"event": "metrics", "step": 3, "tokens_seen": 30, "perf/mfu": 0.1},
            {"event": "metrics", "step": 4, "tokens_seen": 40, "val/loss_k1": 7.0},
            {"event": "metrics", "step": 2, "tokens_seen": 20, "val/loss_k1": 7.9, "val/loss_k2": 8.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"event": "metr')
    want = [{"step": 2, "tokens": 20, "loss": {"1": 7.9, "2": 8.4}}, {"step": 4, "tokens": 40, "loss": {"1": 7.0}}]
    assert read_val_history(tmp_path / "metrics.jsonl") == want
    (tmp_path / "summary.json").write_text(json.dumps({"step": 4, "val_history": want[1:]}))
    assert run_summary(tmp_path) == {"step": 4, "val_history": want}
    (tmp_path / "metrics.jsonl").write_text("")
    assert read_val_history(tmp_path / "metrics.jsonl") == [] and run_summary(tmp_path)["val_history"] == []
    (tmp_path / "metrics.jsonl").unlink()
    assert run_summary(tmp_path) == {"step": 4, "val_history": want[1:]}


def test_curves_average_seeds_at_the_same_steps(tmp_path, monkeypatch):
    """The report's curve of a kind is the mean over seeds at steps every seed validated: a run stopped and
    resumed has an extra point (its stop's validation), which must not shift its later points."""
    from fbt_megatron.research import report, study

    plotted = []

    class Axes:
        def plot(self, x, y, *a, **k):
            plotted.append((list(x), [float(v) for v in y]))

        def __getattr__(self, name):
            return lambda *a, **k: None

    monkeypatch.setattr(report, "figure", lambda **k: (None, [Axes(), Axes()]))
    hist = {1: [(100, 6.0), (150, 5.5), (200, 5.0)], 2: [(100, 6.2), (200, 5.2)]}  # seed 1 stopped at 150
    summaries = {f"standard_seed{s}": {"val_history": [{"step": st, "tokens": st, "loss": {"1": v}} for st, v in h]}
                 for s, h in hist.items()}
    answers = {"standard": {"answer_nll": 2.0, "exact_match": 0.0}}
    readouts = {n: {"val_loss": {"1": 5.0}, "seq_length": 128, "answers": answers, "fusion_history": []}
                for n in summaries}
    args = SimpleNamespace(seeds="1,2", groups="main", scale="tiny", steps=None, lr=1e-3, only=None)
    study.render(summaries, readouts, [1, 2], args, 1.0, tmp_path, "t")
    assert plotted == [([100, 200], [pytest.approx(6.1), pytest.approx(5.1)])]
    assert "--lr 0.001" in (tmp_path / "t.md").read_text()  # the provenance line names an LR variant


def test_the_report_draws_its_figure_into_a_new_folder_and_again_over_its_own(tmp_path):
    """With matplotlib, the report writes its page, JSON and figure into a new --out (the figure after the
    page, so the check of a user's files takes it for the tool's), and a second report replaces all three."""
    pytest.importorskip("matplotlib")
    from fbt_megatron.research import study

    answers = {"standard": {"answer_nll": 2.0, "exact_match": 0.0}}
    summaries = {f"standard_seed{s}": {"val_history": [{"step": 10, "tokens": 10, "loss": {"1": 5.0 + s}}]}
                 for s in (1, 2)}
    readouts = {n: {"val_loss": {"1": 5.0}, "seq_length": 8, "answers": answers, "fusion_history": []}
                for n in summaries}
    args = SimpleNamespace(seeds="1,2", groups="main", scale="tiny", steps=None, lr=None, only=None)
    for _ in range(2):
        study.render(summaries, readouts, [1, 2], args, 1.0, tmp_path / "out", "t")
        assert (tmp_path / "out" / "t.png").read_bytes().startswith(b"\x89PNG")
        assert "![curves and state tracking](t.png)" in (tmp_path / "out" / "t.md").read_text()


def test_a_narrower_report_keeps_the_runs_recorded_before(tmp_path, monkeypatch):
    """A report that selects fewer runs or seeds than the one it replaces keeps the others' records (their
    folders may be gone: the JSON is all that is left of them); a selected run's new record wins."""
    from fbt_megatron.research import report, study

    monkeypatch.setattr(report, "figure", lambda **k: (None, [study._NoAxes(), study._NoAxes()]))
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    from feedback_study import recorded_runs

    answers = {"standard": {"answer_nll": 2.0, "exact_match": 0.0}}

    def run(loss):
        return {"val_history": [{"step": 10, "tokens": 10, "loss": {"1": loss}}],
                "readouts": {"val_loss": {"1": loss}, "seq_length": 8, "answers": answers, "fusion_history": []}}

    args = SimpleNamespace(seeds="1,2", groups="main", scale="tiny", steps=None, lr=None, only=None)
    first = {"standard_seed1": run(5.0), "standard_seed2": run(5.2)}
    study.render({n: r for n, r in first.items()}, {n: r["readouts"] for n, r in first.items()}, [1, 2], args,
                 1.0, tmp_path, "t")
    recorded = recorded_runs(tmp_path / "t.json")
    again = {"standard_seed1": run(4.0)}  # seed 1 only, read out anew
    study.render(again, {n: r["readouts"] for n, r in again.items()}, [1], args, 1.0, tmp_path, "t", kept=recorded)
    kept = recorded_runs(tmp_path / "t.json")
    assert kept["standard_seed2"] == first["standard_seed2"]
    assert kept["standard_seed1"]["readouts"]["val_loss"] == {"1": 4.0}
    assert kept["standard_seed1"]["val_history"][0]["loss"] == {"1": 4.0}
    assert json.loads((tmp_path / "t.json").read_text())["kept"] == ["standard_seed2"]
    assert "not selected here" in (tmp_path / "t.md").read_text()


@pytest.mark.slow  # three short training runs in subprocesses (~1 min)
def test_a_resumed_runs_curve_is_the_uninterrupted_runs(tmp_path, monkeypatch):
    """The study's curves (``val_history``) of a run stopped at step 8 and resumed hold the uninterrupted
    run's validations, those before the stop included (plus the stop's own at step 8); the resumed
    invocation's summary.json has only its own."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    from feedback_study import RECIPE, SMOKE, mix_arg

    from fbt_megatron.research.runs import finished_run, train_run

    overrides = ["seed=3", *SMOKE, "eval.every=3", mix_arg([0.5, 0.4, 0.1])]
    whole = train_run(RECIPE, tmp_path / "whole", overrides)
    cmd = [sys.executable, "-m", "fbt_megatron.cli", "train", str(ROOT / RECIPE), f"run_dir={tmp_path / 'cut'}",
           *overrides]
    env = dict(os.environ, FBT_DEVICE="cpu")  # as train_run's
    for extra in (["train.stop_at_step=8"], []):  # the second invocation resumes from step 8's checkpoint
        done = subprocess.run(cmd + extra, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert [v["step"] for v in json.loads((tmp_path / "cut" / "summary.json").read_text())["val_history"]] == [9, 12]
    resumed = {v["step"]: v for v in finished_run(tmp_path / "cut")["val_history"]}
    assert [v["step"] for v in whole["val_history"]] == [3, 6, 9, 12] and sorted(resumed) == [3, 6, 8, 9, 12]
    for a in whole["val_history"]:
        b = resumed[a["step"]]
        assert a["tokens"] == b["tokens"] and a["loss"].keys() == b["loss"].keys() == {"1", "2", "3"}
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)


def test_one_step_readout_is_zero_when_the_state_is_not_read(single_process):
    """sigma of d h_t / d h_{t-1}: 0 with W_U = 0 (the fed-back state reaches nothing), positive otherwise;
    only positions inside the row are measured."""
    from fbt_megatron.config import FeedbackConfig, ModelConfig
    from fbt_megatron.model.fbt_gpt import build_model
    from fbt_megatron.research.study import one_step_readout

    torch.manual_seed(0)
    model = build_model(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                                    max_sequence_length=40), FeedbackConfig(jitter_std=0.0))
    ids = torch.randint(0, 64, (2, 40))
    read = one_step_readout(model, ids, 40)
    assert read["positions"] == [8, 32] and min(read["spectral_norm"]) > 1e-3
    with torch.no_grad():
        model.feedback.value.weight.zero_()
    assert one_step_readout(model, ids, 40)["spectral_norm"] == [0.0, 0.0]
    with pytest.raises(ValueError, match="hold none of the positions"):
        one_step_readout(model, ids[:, :8], 8)


@pytest.mark.slow  # tools/feedback_study.py end to end in subprocesses (~2 min)
def test_study_smoke_trains_reads_out_and_reports(tmp_path, single_process):
    """The one command of the study at a toy size: the runs train, are read out at 1, 2, 3 passes and
    the exact recurrence, and the report compares them; with the run folders gone, ``--reuse``
    rebuilds the same report from the recorded one without training."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "tools/feedback_study.py"), "--smoke", "--seeds", "1", "--groups", "main,state",
           "--only", "standard,fbt_heavy,state_fbt_heavy", "--jobs", "1", "--runs", str(tmp_path / "runs"),
           "--out", str(out)]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((out / "feedback_study_tiny_orders_smoke.json").read_text())
    fbt = data["readouts"]["fbt_heavy_seed1"]
    assert set(fbt["val_loss"]) == {"1", "2", "3", "128"}  # 128 passes: the exact recurrence at seq_length 128
    assert set(data["readouts"]["standard_seed1"]["val_loss"]) == {"1"}
    assert set(fbt["answers"]) == {"standard", "feedback", "feedback_fused", "feedback_exact"}
    assert set(data["readouts"]["standard_seed1"]["answers"]) == {"standard"}
    _exact_answers_are_the_recurrence(tmp_path / "runs" / "fbt_heavy_seed1", fbt["answers"])
    _exact_loss_is_the_jacobi_fixed_point(tmp_path / "runs" / "fbt_heavy_seed1", fbt["val_loss"]["128"])
    # read out on every source's held-out documents (cut to 8 rows a source in a smoke study), the mix's weights
    assert fbt["validation"] == "held_out" and set(fbt["val_loss_by_source"]) == {"code", "prose", "math"}
    assert fbt["validation_shares"] == pytest.approx({"code": 0.4, "prose": 0.3, "math": 0.3})
    for k, loss in fbt["val_loss"].items():
        assert loss == pytest.approx(0.4 * fbt["val_loss_by_source"]["code"][k] + 0.3 * fbt["val_loss_by_source"]["prose"][k]
                                     + 0.3 * fbt["val_loss_by_source"]["math"][k])
    assert "the same tokens for every run and seed" in (out / "feedback_study_tiny_orders_smoke.md").read_text()
    assert fbt["fusion_history"] and "gate_saturated" in fbt["fusion_history"][-1]
    assert fbt["one_step"]["positions"] == [8, 32, 64, 96, 120] and min(fbt["one_step"]["spectral_norm"]) > 0
    assert "one_step" not in data["readouts"]["standard_seed1"]
    assert len(data["readouts"]["state_fbt_heavy_seed1"]["state_accuracy"]["1"]) == 32
    history = data["val_history"]["fbt_heavy_seed1"][-1]["loss"]
    assert set(history) == {"1", "2", "3"}  # eval.passes of the research recipe
    comparisons = data["comparisons"]["fbt_heavy"]
    assert comparisons["2-pass - 1-pass"][0] == pytest.approx(fbt["val_loss"]["2"] - fbt["val_loss"]["1"])
    md = (out / "feedback_study_tiny_orders_smoke.md").read_text()
    assert "best mode - standard (equal tokens)" in md and "state_fbt_heavy, exact" in md and "one-step σ" in md
    assert "| fbt_heavy | 1 | " in md.split("## Held-out arithmetic")[1] and "FUSED (2-pass) prefill" in md
    state = data["readouts"]["state_fbt_heavy_seed1"]
    assert state["num_layers"] == 4 and "past L" in md
    past = data["comparisons"]["state_fbt_heavy"]["state accuracy past the layer count: exact - 1-pass (same model)"]
    acc = state["state_accuracy"]
    assert past[0] == pytest.approx(sum(acc["32"][4:]) / 28 - sum(acc["1"][4:]) / 28)
    # a run read out before the one-step measure existed gets it added to its cache, the rest kept; a run read
    # out on its own validation sample (the earlier protocol) is read out again
    cache = tmp_path / "runs" / "fbt_heavy_seed1" / "readouts.json"
    cached = json.loads(cache.read_text())
    del cached["one_step"]
    cache.write_text(json.dumps(cached))
    std_cache = tmp_path / "runs" / "standard_seed1" / "readouts.json"
    std_cached = json.loads(std_cache.read_text())
    std_cache.write_text(json.dumps({**std_cached, "validation": "recipe", "val_loss": {"1": 99.0}}))
    refresh = subprocess.run(cmd + ["--summarise-only"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert refresh.returncode == 0, refresh.stdout[-2000:] + refresh.stderr[-2000:]
    assert json.loads(cache.read_text())["one_step"] == fbt["one_step"]
    assert json.loads(std_cache.read_text())["val_loss"] == std_cached["val_loss"]
    shutil.rmtree(tmp_path / "runs")
    # a report recorded before read-outs carried the layer count: the runs' recipes give it
    report = out / "feedback_study_tiny_orders_smoke.json"
    recorded = json.loads(report.read_text())
    for readout in recorded["readouts"].values():
        del readout["num_layers"]
    report.write_text(json.dumps(recorded))
    again = subprocess.run(cmd + ["--reuse"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "[feedback_study]" not in again.stdout, again.stdout[-2000:]
    assert json.loads((out / "feedback_study_tiny_orders_smoke.json").read_text())["comparisons"] == data["comparisons"]
    assert "--reuse" in (out / "feedback_study_tiny_orders_smoke.md").read_text()  # the provenance rebuilds, not retrains
    # a narrower report (one run) keeps the other runs' records: their folders are gone
    narrow = subprocess.run(cmd[:cmd.index("--only") + 1] + ["standard"] + cmd[cmd.index("--only") + 2:]
                            + ["--summarise-only"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert narrow.returncode == 0, narrow.stdout[-2000:] + narrow.stderr[-2000:]
    kept = json.loads((out / "feedback_study_tiny_orders_smoke.json").read_text())
    assert kept["kept"] == ["fbt_heavy_seed1", "state_fbt_heavy_seed1"]
    assert kept["readouts"]["state_fbt_heavy_seed1"] == {**data["readouts"]["state_fbt_heavy_seed1"], "num_layers": 4}


def _exact_loss_is_the_jacobi_fixed_point(run_dir, recorded):
    """The read-out's exact validation loss (documents decoded through the cache) is the loss of
    seq_length Jacobi passes of the training model (the exact recurrence), source by source, weighted by
    the sources' shares of the mix."""
    from fbt_megatron import runtime
    from fbt_megatron.checkpoint.model import load_checkpoint_model
    from fbt_megatron.data.loaders import held_out_sets
    from fbt_megatron.parallel.runner import get_runner
    from fbt_megatron.train.train_step import evaluate

    model, recipe, _ = load_checkpoint_model(run_dir)
    runner, seq = get_runner(model), recipe.data.seq_length
    jacobi = sum(share * evaluate(runner, batches, seq, runtime.device()).loss
                 for _, share, batches in held_out_sets(recipe, max_rows=recipe.data.valid_sequences))
    assert recorded == pytest.approx(jacobi, rel=1e-5)


def _exact_answers_are_the_recurrence(run_dir, answers):
    """Reference: each held-out answer's NLL per token under the exact recurrence (the sequential
    reference over question and answer as one sequence); the 1-pass and FUSED prefills read otherwise."""
    from fbt_megatron.generate.api import TextGenerator
    from fbt_megatron.generate.loading import load_for_inference
    from fbt_megatron.model.sequential import sequential_forward
    from fbt_megatron.research.sft import held_out_problems

    gen = TextGenerator(load_for_inference(run_dir), mode="feedback", prefill_passes="exact")
    pairs = held_out_problems(len(answers["feedback_exact"]["per_problem_nll"]))
    want = []
    for q, a in pairs:
        context, answer = gen.encode(f"Question: {q}\nAnswer:"), gen.encode(f" {a}")
        with torch.no_grad():
            logits = sequential_forward(gen.decoder.model, torch.tensor([context + answer])).logits[0].double()
        logp = torch.log_softmax(logits[len(context) - 1:-1, :gen.decoder.model.model_config.vocab_size], -1)
        want.append(-float(logp[torch.arange(len(answer)), torch.tensor(answer)].sum()) / len(answer))
    assert answers["feedback_exact"]["per_problem_nll"] == pytest.approx(want, rel=1e-4)
    for prefill in ("feedback", "feedback_fused"):
        assert answers[prefill]["per_problem_nll"] != pytest.approx(want, rel=1e-4), prefill


def test_summary_pairs_runs_by_seed_and_picks_one_mode_for_all_seeds():
    """Paired differences from hand-made read-outs: k-pass - 1-pass within a run, and the mode with the
    lowest mean over seeds (not each seed's minimum) against the standard model of the same seed."""
    from fbt_megatron.research.study import summarise

    def ro(**losses):
        return {"seq_length": 8, "val_loss": {k.lstrip("p"): v for k, v in losses.items()}}

    readouts = {"standard_seed1": ro(p1=4.0), "standard_seed2": ro(p1=4.2),
                "fbt_seed1": ro(p1=4.5, p2=4.1, p3=4.3, p8=3.9), "fbt_seed2": ro(p1=4.4, p2=4.2, p3=4.1, p8=4.5),
                "standard_compute_fbt_seed1": ro(p1=3.8),
                "fbt_untied_seed1": ro(p1=4.3, p2=4.0), "standard_untied_seed1": ro(p1=3.9)}
    rows = summarise({n: {} for n in readouts}, readouts)["fbt"]
    mean, err, n = rows["2-pass - 1-pass"]
    assert (mean, n) == (pytest.approx(-0.3), 2) and err == pytest.approx(0.1)  # stdev(-0.4, -0.2) / sqrt(2)
    assert rows["exact - 1-pass"][0] == pytest.approx((-0.6 + 0.1) / 2)
    # means: 1: 4.45, 2: 4.15, 3: 4.2, 8: 4.2 -> 2 passes (each seed's minimum would be 3.9 and 4.1)
    assert rows["best mode"] == "2"
    assert rows["best mode - standard (equal tokens)"][0] == pytest.approx(((4.1 - 4.0) + (4.2 - 4.2)) / 2)
    assert rows["best mode - standard (equal compute)"][:3:2] == (pytest.approx(4.1 - 3.8), 1)
    assert not any("same change" in name for name in rows)
    # a change to the model itself (untied embeddings) is also compared with the standard model so changed
    untied = summarise({n: {} for n in readouts}, readouts)["fbt_untied"]
    assert untied["best mode - standard_untied (same change, equal tokens)"][:3:2] == (pytest.approx(4.0 - 3.9), 1)
    assert untied["best mode - standard (equal tokens)"][:3:2] == (pytest.approx(4.0 - 4.0), 1)
    # untied plus a fusion-only change: its baseline is still the untied standard model
    readouts["fbt_heavy_untied_fusion_lr_x10_seed1"] = ro(p1=4.2, p2=3.7)
    readouts["fbt_heavy_seed1"] = ro(p1=4.6, p2=4.5)
    rows = summarise({n: {} for n in readouts}, readouts)
    both = rows["fbt_heavy_untied_fusion_lr_x10"]
    assert both["best mode - standard_untied (same change, equal tokens)"][:3:2] == (pytest.approx(3.7 - 3.9), 1)
    assert not any("same change" in name for name in rows["fbt_heavy"])


def test_state_summary_pairs_accuracy_past_the_layer_count_by_seed():
    """Goal (c)'s numbers from hand-made read-outs: mean accuracy over the positions past the layer count
    (position t holds t + 1 composed steps), feedback decoding (the exact recurrence) against 1 pass of
    the same model and against the standard model of the same seed."""
    from fbt_megatron.research.study import accuracy_past_layer_count, summarise

    def ro(layers=2, **acc):  # 6 positions, 2 layers: positions 2..5 lie past the layer count
        return {"seq_length": 6, "num_layers": layers, "state_accuracy": {k.lstrip("p"): v for k, v in acc.items()}}

    # the standard model has seeds 2 and 3: only seed 2 pairs with FBT's seeds 1 and 2
    readouts = {"state_standard_seed2": ro(p1=[1, 1, .3, .1, .2, .2]),
                "state_standard_seed3": ro(p1=[1, 1, .1, .1, .1, .1]),
                "state_fbt_heavy_seed1": ro(p1=[1, 1, .2, .2, .2, .2], p6=[1, 1, .6, .4, .4, .2]),
                "state_fbt_heavy_seed2": ro(p1=[1, 1, .2, .2, .2, .4], p6=[0, 0, .5, .5, .5, .5])}
    past = accuracy_past_layer_count(readouts["state_fbt_heavy_seed1"])
    assert past == {"1": pytest.approx(.2), "6": pytest.approx(.4)}
    row = summarise({n: {} for n in readouts}, readouts)["state_fbt_heavy"]
    mean, err, n = row["state accuracy past the layer count: exact - 1-pass (same model)"]
    assert (mean, n) == (pytest.approx(((.4 - .2) + (.5 - .25)) / 2), 2)
    assert err == pytest.approx(.025)  # stdev(.2, .25) / sqrt(2)
    mean, err, n = row["state accuracy past the layer count: exact - state_standard"]
    assert (mean, n) == (pytest.approx(.5 - .2), 1) and math.isnan(err)  # seed 2: exact .5, standard .2
    assert "state_standard" not in summarise({n: {} for n in readouts}, readouts)
    # a read-out without the layer count gives no row rather than a wrong one
    del readouts["state_fbt_heavy_seed2"]["num_layers"]
    assert "state_fbt_heavy" not in summarise({n: {} for n in readouts}, readouts)


def test_the_printed_command_names_the_fbt_recipe_of_the_runs():
    from argparse import Namespace

    from fbt_megatron.research.study import study_command

    args = Namespace(seeds="1,2,3", groups="form,budget", scale="medium", steps=1200, lr=6e-4, only=None,
                     fbt_recipe="loss_mean", shared_data_order=False, summarise_only=False, reuse=True)
    assert study_command(args) == ("python tools/feedback_study.py --seeds 1,2,3 --groups form,budget --scale medium "
                                   "--steps 1200 --lr 0.0006 --fbt-recipe loss_mean --reuse")
    args.fbt_recipe, args.summarise_only = "base", True
    assert study_command(args).endswith("--lr 0.0006 --summarise-only")


def test_an_untied_state_run_is_paired_with_the_untied_standard_state_run():
    """E2's state runs change the model (untied): their accuracy past the layer count is compared with the
    standard model with the same change, and that standard run gets no row of its own."""
    from fbt_megatron.research.study import summarise, summary_rows

    def ro(**acc):  # 4 positions, 1 layer: positions 1..3 lie past the layer count
        return {"seq_length": 4, "num_layers": 1, "state_accuracy": {k.lstrip("p"): v for k, v in acc.items()}}

    readouts = {"state_standard_untied_seed1": ro(p1=[1, .2, .2, .2]),
                "state_standard_untied_seed2": ro(p1=[1, .3, .3, .3]),
                "state_fbt_heavy_untied_fusion_lr_x10_additive_seed1": ro(p1=[1, .2, .2, .2], p4=[1, .5, .5, .5]),
                "state_fbt_heavy_untied_fusion_lr_x10_additive_seed2": ro(p1=[1, .3, .3, .3], p4=[1, .9, .9, .9])}
    rows = summarise({n: {} for n in readouts}, readouts)
    assert set(rows) == {"state_fbt_heavy_untied_fusion_lr_x10_additive"}
    mean, err, n = rows["state_fbt_heavy_untied_fusion_lr_x10_additive"][
        "state accuracy past the layer count: exact - state_standard_untied (same change)"]
    assert (mean, n) == (pytest.approx(((.5 - .2) + (.9 - .3)) / 2), 2)
    assert err == pytest.approx(.15)  # stdev(.3, .6) / sqrt(2)
    # the study page's question about the standard model is answered by that row
    (row,) = [r for r in summary_rows(rows) if r[0].endswith("better than a standard model?")]
    assert row[2].startswith("state_fbt_heavy_untied_fusion_lr_x10_additive: +0.450")


def test_gate_saturation_reads_the_gate_with_its_bias_and_only_under_glu(single_process):
    """sigmoid(W_G e + b_G): a bias of +20 saturates every entry whatever W_G e is; the additive fusion
    has no sigmoid, so no saturation is read."""
    from fbt_megatron.model.fbt_gpt import build_model
    from fbt_megatron.recipe import load_recipe
    from fbt_megatron.research.study import fusion_state

    model_cfg = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "vocab_size": 64, "max_sequence_length": 16}
    for fusion in ("glu", "additive"):
        recipe = load_recipe(data={"model": model_cfg, "feedback": {"fusion": fusion, "bias": True}, "data": {"seq_length": 16, "synthetic": {"vocab_size": 64}}})
        model = build_model(recipe.model, recipe.feedback)
        with torch.no_grad():
            model.feedback.gate.weight.mul_(1e-3)
            model.feedback.gate.bias.fill_(20.0)
        state = fusion_state(model, recipe, None)
        if fusion == "glu":
            assert state["gate_saturated"] == 1.0 and state["gate_mean"] > 0.99
        else:
            assert "gate_saturated" not in state and "w_u_norm" in state


def test_an_interrupted_run_resumes_only_when_started_with_the_same_command(tmp_path, monkeypatch):
    """``train_run(resume=True)`` keeps a run folder holding a checkpoint of the same command (the trainer
    resumes from it); another command, or ``resume=False``, starts from scratch."""
    import json
    import subprocess

    from fbt_megatron.research import runs

    calls = []

    def fake_run(cmd, cwd, env, stdout, stderr):
        run_dir = Path(cmd[cmd.index("train") + 2].split("=", 1)[1])
        calls.append(sorted(p.name for p in run_dir.iterdir()))
        (run_dir / "summary.json").write_text(json.dumps({"step": 1, "total_steps": 1}))
        (run_dir / "checkpoints").mkdir(exist_ok=True)
        (run_dir / "checkpoints" / "latest").write_text("step_1")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(runs.subprocess, "run", fake_run)
    run_dir = tmp_path / "run"
    runs.train_run("recipes/tiny.yaml", run_dir, ["seed=1"], resume=True)
    assert calls[-1] == ["command.json", "train.log"]  # nothing to resume: a fresh folder
    runs.train_run("recipes/tiny.yaml", run_dir, ["seed=1"], resume=True)
    assert "checkpoints" in calls[-1]  # the same command: the checkpoint is kept
    runs.train_run("recipes/tiny.yaml", run_dir, ["seed=2"], resume=True)
    assert "checkpoints" not in calls[-1]  # another command: from scratch
    runs.train_run("recipes/tiny.yaml", run_dir, ["seed=2"], resume=False)
    assert "checkpoints" not in calls[-1]


def test_each_seed_has_its_own_data_order_and_a_seeds_runs_share_it(monkeypatch):
    """The study gives every seed its own data order (``data.seed``), the same for all runs of the seed
    (the FBT and the standard run stay paired): the state task's first training batches differ between
    seeds and match within one; the language-model runs' data pipeline gets the seed. The earlier
    studies' protocol (``shared_order``) keeps every seed on data seed 0."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    from feedback_study import RECIPE, plan, run_overrides

    from fbt_megatron.data.loaders import build_train_loader
    from fbt_megatron.resolve.resolver import resolve_run
    from fbt_megatron.recipe import load_recipe

    def recipe(runs, name, seed, shared=False):
        return load_recipe(ROOT / RECIPE, run_overrides(runs, name, seed, shared))

    def first_batch(r):
        return next(iter(build_train_loader(r, 0, 1, 0)))["input_ids"]

    state = plan(["state"], "tiny", True)
    fbt1, std1 = first_batch(recipe(state, "state_fbt_heavy", 1)), first_batch(recipe(state, "state_standard", 1))
    std2 = first_batch(recipe(state, "state_standard", 2))
    assert torch.equal(fbt1, std1) and not torch.equal(std1, std2)
    e1 = plan(["recipe"], "tiny", True)  # E1's state runs: one order per seed, shared by the seed's runs
    base = "state_fbt_heavy_untied_fusion_lr_x10"
    one = [first_batch(recipe(e1, n, 1)) for n in ("state_standard_untied", base, f"{base}_loss_mean")]
    assert all(torch.equal(one[0], b) for b in one[1:])
    assert not torch.equal(one[0], first_batch(recipe(e1, "state_standard_untied", 2)))
    shared = plan(["state"], "tiny", True, shared_order=True)
    assert torch.equal(first_batch(recipe(shared, "state_standard", 1, True)),
                       first_batch(recipe(shared, "state_standard", 2, True)))
    mix = {"tokenizer": "tok.model", "seed": 0, "sources": [{"name": "a", "path": "a", "weight": 1.0}]}
    lm = {n: o for n, o in plan(["recipe"], "tiny", False, 1200, 1e-3).items() if not n.startswith("state_")}
    seeds = {}
    for name in lm:
        for seed in (1, 2, 3):
            r = recipe(lm, name, seed)
            r.data.pipeline = dict(mix)
            seeds[name, seed] = resolve_run(r, 1, data_files=False).data.config["seed"]  # what the loaders get
            assert r.seed == seed
    assert seeds == {(name, seed): seed for name in lm for seed in (1, 2, 3)}
    r = recipe(plan(["recipe"], "tiny", False, 1200, 1e-3, shared_order=True), "standard_untied", 2, True)
    r.data.pipeline = dict(mix)
    assert resolve_run(r, 1, data_files=False).data.config["seed"] == 0 and r.data.valid_sequences == 64


def test_recipe_group_is_e1_at_eight_times_the_validation_tokens(monkeypatch):
    """E1's runs: the untied standard model, the best FBT configuration (untied, fusion LR x10, 50/40/10)
    and that configuration with loss_on mean, and with the switch at 50 % of the steps; validated on
    >= 8 x 8,192 held-out tokens."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    from feedback_study import RECIPE, plan

    from fbt_megatron.recipe import load_recipe

    runs = {n: load_recipe(ROOT / RECIPE, o) for n, o in plan(["recipe"], "tiny", False, 1200, 1e-3).items()}
    base = "fbt_heavy_untied_fusion_lr_x10"
    assert set(runs) == {"standard_untied", base, f"{base}_loss_mean", f"{base}_switch50",
                         "state_standard_untied", f"state_{base}", f"state_{base}_loss_mean"}
    # the S3 state task for the standard model, the unchanged recipe and loss_on mean, each as its language run
    for name in ("standard_untied", base, f"{base}_loss_mean"):
        r, lm = runs.pop(f"state_{name}"), runs[name]
        assert (r.data.source, r.data.synthetic.task, r.data.seq_length) == ("synthetic", "state_tracking", 32), name
        assert (r.optimizer, r.schedule, r.feedback, r.model.tie_embeddings) == (
            lm.optimizer, lm.schedule, lm.feedback, False), name
    for name, r in runs.items():
        assert r.data.valid_sequences * r.data.seq_length >= 8 * 8192, name
        assert (r.optimizer.lr, r.train.steps, r.model.tie_embeddings) == (1e-3, 1200, False), name
        assert r.feedback.fusion == ("off" if name == "standard_untied" else "glu"), name
        if name != "standard_untied":
            assert r.schedule.mix == [0.5, 0.4, 0.1] and r.optimizer.fusion_lr_multiplier == 10.0, name
    assert (runs[base].feedback.loss_on, runs[base].schedule.feedback_start_step) == ("last", 240)
    assert (runs[f"{base}_loss_mean"].feedback.loss_on, runs[f"{base}_loss_mean"].schedule.feedback_start_step) == ("mean", 240)
    assert (runs[f"{base}_switch50"].feedback.loss_on, runs[f"{base}_switch50"].schedule.feedback_start_step) == ("last", 600)


def test_t_interval_matches_textbook_values():
    """Student's t quantiles, and the paired interval of R's ``t.test(extra ~ group, data = sleep,
    paired = TRUE)`` (Cushny and Peebles' sleep data: mean 1.58, 95 % interval [0.700, 2.460])."""
    import statistics

    from fbt_megatron.research.study import (ci_text, difference_interval, paired, t_critical, t_interval,
                                             verdict)

    assert t_critical(2) == pytest.approx(4.303, abs=5e-4) and t_critical(1) == pytest.approx(12.706, abs=5e-4)
    assert t_critical(9) == pytest.approx(2.262, abs=5e-4)
    group1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
    group2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]
    mean, err, n = paired(group1, group2)
    assert (mean, n) == (pytest.approx(1.58), 10)
    assert err == pytest.approx(statistics.stdev([b - a for a, b in zip(group1, group2)]) / math.sqrt(10))
    assert t_interval(mean, err, n) == (pytest.approx(0.7001142, abs=1e-6), pytest.approx(2.4598858, abs=1e-6))
    # the audit's medium 6e-4 numbers: 2 passes - 1 pass over three seeds
    lo, hi = t_interval(-0.039, 0.0075, 3)
    assert (lo, hi) == (pytest.approx(-0.039 - 4.3027 * 0.0075, abs=1e-4), pytest.approx(-0.039 + 4.3027 * 0.0075, abs=1e-4))
    assert all(math.isnan(x) for x in t_interval(0.1, float("nan"), 1))
    assert ci_text(-0.039, 0.0075, 3) == "-0.039 [-0.071, -0.007]" and ci_text(0.08, float("nan"), 1) == "+0.080"
    diff, lo, hi = difference_interval((0.150, 0.003, 2), (0.089, 0.005, 3))  # df = min(2, 3) - 1 = 1
    assert diff == pytest.approx(-0.061) and hi - diff == pytest.approx(12.706 * math.hypot(0.003, 0.005), abs=1e-3)
    assert verdict(-0.07, -0.01, -1) == "supported" and verdict(0.07, 0.11, -1) == "ruled out"
    assert verdict(-0.07, 0.02, -1) == "undecided" == verdict(float("nan"), float("nan"), 1)


def test_report_names_paths_relative_to_the_run_and_the_repository(tmp_path):
    """A report's JSON names no machine's paths: the checkpoint relative to its run folder, the runs and
    output folders relative to the repository (or by name outside it)."""
    from fbt_megatron.research.runs import ROOT as REPO
    from fbt_megatron.research.study import portable_args, relative_to_run

    run = tmp_path / "fbt_seed1"
    assert relative_to_run(run / "checkpoints" / "step_00001200", run) == "checkpoints/step_00001200"
    args = portable_args({"runs": str(tmp_path / "tiny_orders"), "out": str(REPO / "docs/results"), "seeds": "1"})
    assert args == {"runs": "tiny_orders", "out": "docs/results", "seeds": "1"}


def test_a_recipe_change_is_paired_with_the_unchanged_runs_best_mode():
    """E1's numbers from hand-made read-outs: a recipe variant's best mode against the unchanged run's
    best mode (each the lowest mean over seeds), and FBT's 1-pass deficit against the standard model."""
    from fbt_megatron.research.study import summarise

    def ro(**losses):
        return {"seq_length": 8, "val_loss": {k.lstrip("p"): v for k, v in losses.items()}}

    base = "fbt_heavy_untied_fusion_lr_x10"
    readouts = {"standard_untied_seed1": ro(p1=3.95), "standard_untied_seed2": ro(p1=3.96),
                f"{base}_seed1": ro(p1=4.16, p2=4.10, p3=4.12, p8=4.13),
                f"{base}_seed2": ro(p1=4.15, p2=4.11, p3=4.13, p8=4.14),
                f"{base}_loss_mean_seed1": ro(p1=4.03, p2=4.06, p3=4.08, p8=4.09),
                f"{base}_loss_mean_seed2": ro(p1=4.05, p2=4.06, p3=4.08, p8=4.09)}
    rows = summarise({n: {} for n in readouts}, readouts)
    change = rows[f"{base}_loss_mean"][f"best mode - {base} best mode (2 passes; the recipe change)"]
    assert change[0] == pytest.approx(((4.03 - 4.10) + (4.05 - 4.11)) / 2) and change[2] == 2
    deficit = rows[base]["1-pass - standard_untied (FBT's 1-pass deficit)"]
    assert deficit[0] == pytest.approx(((4.16 - 3.95) + (4.15 - 3.96)) / 2)
    assert not any("recipe change" in name for name in rows[base])


def test_token_multiplier_inverts_a_loss_linear_in_log_tokens():
    """m = D_standard(L_FBT) / D_FBT: with standard losses on L = 6 - 0.5 ln D (per seed), an FBT loss of
    the standard model's at 0.8 D gives m = 0.8 inside the runs and past their ends; per seed, paired."""
    from fbt_megatron.research.hypotheses import estimate, multiplier_by_seed, standard_tokens_for

    def loss(d, shift=0.0):
        return 6.0 - 0.5 * math.log(d) + shift

    points = [(d, loss(d)) for d in (1e6, 2e6, 4e6)]
    for d in (0.5e6, 1.5e6, 3e6, 8e6):
        assert standard_tokens_for(points, loss(d)) == pytest.approx(d)
    kink = [(1e6, 5.0), (2e6, 4.0), (4e6, 3.5)]  # piecewise: each segment its own slope
    assert standard_tokens_for(kink, 3.75) == pytest.approx(2e6 * 2 ** 0.5)
    assert standard_tokens_for(kink, 4.5) == pytest.approx(1e6 * 2 ** 0.5)
    assert standard_tokens_for(kink, 5.5) == pytest.approx(1e6 / 2 ** 0.5)  # past the first run

    def report(kind, losses):  # {seed: loss} of one kind, as a study report holds it
        return {"comparisons": {kind: {"best mode": "2"}} if kind != "standard_untied" else {},
                "readouts": {f"{kind}_seed{s}": {"val_loss": {"2" if kind != "standard_untied" else "1": v}}
                             for s, v in losses.items()}}

    shifts = {1: 0.0, 2: 0.1}  # seed 2's standard model is worse throughout: m is per seed
    standard = {d: report("standard_untied", {s: loss(d, sh) for s, sh in shifts.items()}) for d in (1e6, 2e6, 4e6)}
    fbt = report("fbt", {1: loss(0.8 * 2e6), 2: loss(0.9 * 2e6, 0.1)})
    m = multiplier_by_seed(standard, fbt, "fbt", 2e6)
    assert m == {1: pytest.approx(0.8), 2: pytest.approx(0.9)}
    mean, err, n = estimate(m)
    assert (mean, n) == (pytest.approx(0.85), 2) and err == pytest.approx(0.05)


def test_summary_rows_give_the_interval_and_the_verdict_and_wait_for_missing_runs(tmp_path):
    """A row's number is its report's paired difference with the t-interval; the verdict follows the
    interval's side of zero (or of 1 for m); a report not written yet leaves the row pending; the table
    goes between the write-up's markers, and a write-up without them is refused in one sentence."""
    from fbt_megatron.research.hypotheses import (BEGIN, END, Hypothesis, Reports, _cmp, replace_summary,
                                                  row_cells)

    comparisons = {"k": {"2-pass - 1-pass": [-0.039, 0.0075, 3], "exact - 1-pass": [-0.025, 0.010, 3],
                         "one seed": [0.1, float("nan"), 1]}}
    (tmp_path / "feedback_study_s.json").write_text(json.dumps({"comparisons": comparisons, "readouts": {}}))
    reports = Reports(tmp_path)

    def cells(prefix, sign=-1, stem="s"):
        return row_cells(Hypothesis("a", "c", "e", "m", _cmp(stem, "k", prefix), sign, pending="running"), reports)

    assert cells("2-pass")[4:] == ["-0.039 [-0.071, -0.007]", "3", "supported"]
    assert cells("2-pass", +1)[-1] == "ruled out"
    assert cells("exact")[-1] == "undecided at this scale"
    assert cells("one seed")[4:] == ["+0.100", "1", "undecided (one seed)"]
    assert cells("2-pass", stem="missing")[4:] == ["–", "–", "running"]
    m = Hypothesis("b", "m > 1", "e", "m", lambda r: (0.82, 0.01, 2), +1, null=1.0)
    assert row_cells(m, reports)[4:] == ["0.82× [0.69, 0.95]", "2", "ruled out"]
    doc = f"# T\n\n{BEGIN}\nold\n{END}\n\nrest\n"
    assert replace_summary(doc, "| new |") == f"# T\n\n{BEGIN}\n| new |\n{END}\n\nrest\n"
    with pytest.raises(ValueError, match="no markers for this table"):
        replace_summary("# T\n", "| new |")


def test_old_reports_paths_become_relative(tmp_path, monkeypatch):
    """A report written with machine paths: the checkpoint relative to its run folder, the folders by name;
    the same from any working directory (tools/feedback_summary.py may run outside the repository)."""
    from fbt_megatron.research.hypotheses import portable_report

    monkeypatch.chdir(tmp_path)

    data = {"args": {"runs": "/work/study_runs/tiny_600", "out": "/work/main/docs/results", "seeds": "1,2"},
            "readouts": {"standard_seed1": {"checkpoint": "/work/study_runs/tiny_600/standard_seed1/checkpoints/step_00000600"},
                         "state_seed1": {"checkpoint": "checkpoints/step_00000600"}}}
    out = portable_report(data)
    assert out["args"] == {"runs": "tiny_600", "out": "docs/results", "seeds": "1,2"}
    assert out["readouts"]["standard_seed1"]["checkpoint"] == "checkpoints/step_00000600"
    assert out["readouts"]["state_seed1"]["checkpoint"] == "checkpoints/step_00000600"
    assert "/work" not in json.dumps(out)


def test_e1_rows_read_the_comparisons_the_study_writes(tmp_path):
    """The summary's E1 rows find the rows ``summarise`` writes for the recipe group (names kept in step):
    pending without the report, numbers with it."""
    from fbt_megatron.research.hypotheses import E1, HYPOTHESES, Reports, row_cells
    from fbt_megatron.research.study import summarise

    base = "fbt_heavy_untied_fusion_lr_x10"
    readouts = {}
    for seed, shift in ((1, 0.0), (2, 0.01), (3, -0.01)):
        readouts[f"standard_untied_seed{seed}"] = {"seq_length": 8, "val_loss": {"1": 3.95 + shift}}
        for kind, losses in ((base, (4.16, 4.10)), (f"{base}_loss_mean", (4.03, 4.06)), (f"{base}_switch50", (4.09, 4.10))):
            readouts[f"{kind}_seed{seed}"] = {"seq_length": 8, "val_loss": {"1": losses[0] + shift, "2": losses[1] + 2 * shift}}
    # the state task (accuracy per composed step; layer count 2, so "past L" is steps 3..4) and the answers
    for seed, shift in ((1, 0.0), (2, 0.02), (3, -0.02)):
        readouts[f"state_{base}_seed{seed}"] = {"seq_length": 4, "num_layers": 2, "state_accuracy": {
            "1": [1, 1, 0.5, 0.3], "4": [1, 1, 0.6 + shift, 0.6 + shift]}}
        readouts[f"state_{base}_loss_mean_seed{seed}"] = {"seq_length": 4, "num_layers": 2, "state_accuracy": {
            "1": [1, 1, 0.5, 0.5], "4": [1, 1, 0.9 + shift, 0.7 + shift]}}
        readouts[f"{base}_seed{seed}"]["answers"] = {"standard": {"answer_nll": 2.0}, "feedback_fused": {"answer_nll": 1.9}}
        readouts[f"{base}_loss_mean_seed{seed}"]["answers"] = {
            "standard": {"answer_nll": 1.8 + shift}, "feedback_fused": {"answer_nll": 1.75 + 3 * shift}}
    e1 = [h for h in HYPOTHESES if h.experiment.startswith("E1")]
    assert len(e1) == 10 and all(row_cells(h, Reports(tmp_path))[-1] == "running" for h in e1)
    report = {"comparisons": summarise({n: {} for n in readouts}, readouts), "readouts": readouts}
    (tmp_path / f"feedback_study_{E1}.json").write_text(json.dumps(report))
    rows = {h.claim: row_cells(h, Reports(tmp_path)) for h in e1}
    assert rows["`loss_on: mean` narrows FBT's gap to the standard model"][4].startswith("-0.070 [")  # 4.03 - 4.10
    assert rows["a switch at 50 % of the steps narrows the gap"][4].startswith("-0.010 [")  # 4.09 - 4.10
    assert rows["with `loss_on: mean`, FBT is ahead of the standard model"][4].startswith("+0.080 [")  # 4.03 - 3.95
    assert rows["FBT's 1-pass mode is behind the standard model (the recipe's deficit)"][4].startswith("+0.210 [")
    # 2 passes - 1 pass: the unchanged recipe 4.10 - 4.16 + shift, loss_mean 4.06 - 4.03 + shift
    assert rows["2 passes beat 1 pass under the unchanged recipe"][4].startswith("-0.060 [")
    assert rows["with `loss_on: mean`, 2 passes still beat 1 pass (the fed-back gain survives)"][4].startswith("+0.030 [")
    t2 = T_975_DF2
    half = t2 * 0.02 / 3 ** 0.5  # shifts 0, +0.02, -0.02: standard deviation 0.02, standard error 0.02 / sqrt(3)
    # past L: loss_mean exact (0.9 + 0.7) / 2 + shift against its 1 pass's 0.5: +0.3 + shift
    reads = rows["with `loss_on: mean`, the model still reads its fed-back state"]
    assert reads[4] == f"+0.300 [{0.3 - half:+.3f}, {0.3 + half:+.3f}]" and reads[-1] == "supported"
    # exact past L: loss_mean 0.8 + shift against the unchanged recipe's 0.6 + shift
    assert rows["`loss_on: mean` tracks the state better than the unchanged recipe"][4].startswith("+0.200 [")
    # answer NLL, loss_mean: FUSED 1.75 + 3 shift - standard 1.8 + shift = -0.05 + 2 shift
    decoding = rows["with `loss_on: mean`, feedback decoding reads held-out answers better than standard decoding"]
    assert decoding[4] == f"-0.050 [{-0.05 - 2 * half:+.3f}, {-0.05 + 2 * half:+.3f}]"
    assert decoding[-1] == "undecided at this scale"
    # FUSED - standard: loss_mean -0.05 + 2 shift against the unchanged recipe's 1.9 - 2.0 = -0.1
    assert rows["`loss_on: mean` widens feedback decoding's lead over standard decoding"][4].startswith("+0.050 [")
    assert all(r[5] == "3" for r in rows.values())


def test_a_study_page_opens_with_its_answers():
    """The summary counts the variants whose paired 95 % t-interval supports, rules out or leaves open each
    claim, and shows, among the variants with the most seeds, the one furthest on the claim's side; a
    comparison without seeds (its baseline not in the study) is left out."""
    from fbt_megatron.research.study import summary_rows

    t2 = T_975_DF2
    comparisons = {
        # best - standard: +0.10 ± 0.01 over 3 seeds: interval [+0.057, +0.143], behind: "ruled out"
        "fbt_a": {"seeds": [1, 2, 3], "best mode": "2", "2-pass - 1-pass": (-0.05, 0.01, 3),
                  "best mode - standard (equal tokens)": (0.10, 0.01, 3)},
        # -0.02 ± 0.01 over 3: [-0.063, +0.023]: undecided; its same-change row is the one used
        "fbt_b_untied": {"seeds": [1, 2, 3], "best mode": "1", "2-pass - 1-pass": (-0.02, 0.01, 3),
                         "best mode - standard (equal tokens)": (5.0, 0.01, 3),
                         "best mode - standard_untied (same change, equal tokens)": (-0.02, 0.01, 3)},
        # one seed only: never the variant shown when others have more; no baseline: no row
        "fbt_c": {"seeds": [1], "best mode": "2", "2-pass - 1-pass": (-0.9, float("nan"), 1),
                  "best mode - standard (equal tokens)": (float("nan"), float("nan"), 0)},
    }
    rows = {r[0]: r for r in summary_rows(comparisons)}
    ahead = rows["Is a fed-back model ahead of the standard model at equal tokens?"]
    assert ahead[1] == "1 ruled out, 1 undecided (of 2 variants)"
    lo, hi = -0.02 - t2 * 0.01, -0.02 + t2 * 0.01
    assert ahead[2] == f"fbt_b_untied: -0.020 [{lo:+.3f}, {hi:+.3f}] (3 seeds)"
    passes = rows["Do 2 passes beat 1 pass of the same model?"]
    assert passes[1] == "1 supported, 1 undecided, 1 with one seed (no interval) (of 3 variants)"  # fbt_a: [-0.093, -0.007]
    assert passes[2].startswith("fbt_a: -0.050 [")
    assert not any("state" in q for q in rows)  # no state comparisons: no such question
    # a claim of a positive difference: the largest mean is the one shown; one seed has no interval
    comparisons = {
        "state_a": {"seeds": [1, 2, 3], "state accuracy past the layer count: exact - state_standard": (0.02, 0.01, 3)},
        "state_b": {"seeds": [1, 2, 3], "state accuracy past the layer count: exact - state_standard": (0.08, 0.01, 3)},
        "state_c": {"seeds": [1], "state accuracy past the layer count: exact - state_standard": (0.5, float("nan"), 1)},
    }
    (row,) = summary_rows(comparisons)
    assert row[1] == "1 supported, 1 undecided, 1 with one seed (no interval) (of 3 variants)"
    assert row[2].startswith("state_b: +0.080 [")


def test_form_and_budget_groups_plan_e2_and_e3_and_share_e1s_runs(monkeypatch):
    """E2 (``form``): the untied standard model, the untied x10 50/40/10 FBT run with the GLU and with the
    additive fusion, and the state task for the three; E3 (``budget``): the untied standard model at 0.5x, 1x
    and 2x the steps, each with its own full schedule, FBT at 1x and 2x. ``--fbt-recipe`` gives their FBT
    runs an E1 recipe change and its name suffix; the 1x runs are E1's runs, name and overrides."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    from feedback_study import RECIPE, plan

    from fbt_megatron.recipe import load_recipe
    from fbt_megatron.research.study import same_change_baseline

    x10 = "fbt_heavy_untied_fusion_lr_x10"
    e1 = plan(["recipe"], "tiny", False, 1200, 1e-3)
    names = {}
    for fbt_recipe, suffix, loss_on, switch in (("base", "", "last", 240), ("loss_mean", "_loss_mean", "mean", 240),
                                               ("switch50", "_switch50", "last", 600)):
        form = plan(["form"], "medium", False, 1200, 6e-4, fbt_recipe=fbt_recipe)
        assert set(form) == {"standard_untied", f"{x10}{suffix}", f"{x10}_additive{suffix}", "state_standard_untied",
                             f"state_{x10}{suffix}", f"state_{x10}_additive{suffix}"}
        for name, overrides in form.items():
            r = load_recipe(ROOT / RECIPE, overrides)
            assert (r.model.num_layers, r.model.hidden_size, r.optimizer.lr, r.train.steps) == (8, 384, 6e-4, 1200)
            assert not r.model.tie_embeddings, name
            state = name.startswith("state_")
            assert (r.data.source == "synthetic" and r.data.synthetic.task == "state_tracking"
                    and r.data.synthetic.group == "symmetric" and r.data.seq_length == 32) == state, name
            if "standard" in name:
                assert r.feedback.fusion == "off", name
                continue
            assert r.feedback.fusion == ("additive" if "_additive" in name else "glu"), name
            assert r.schedule.mix == [0.5, 0.4, 0.1] and r.optimizer.fusion_lr_multiplier == 10.0, name
            assert (r.feedback.loss_on, r.schedule.feedback_start_step) == (loss_on, switch), name
        budget = plan(["budget"], "tiny", False, 1200, 1e-3, fbt_recipe=fbt_recipe)
        two = f"fbt_heavy_untied_steps2400_fusion_lr_x10{suffix}"
        assert set(budget) == {"standard_untied_steps600", "standard_untied", "standard_untied_steps2400",
                               f"{x10}{suffix}", two}
        for name in ("standard_untied", f"{x10}{suffix}"):  # 1x: E1's run, trained once for both
            assert budget[name] == e1[name], name
        for name, (steps, start) in {"standard_untied_steps600": (600, 120), "standard_untied_steps2400": (2400, 480),
                                     two: (2400, 1200 if fbt_recipe == "switch50" else 480)}.items():
            r = load_recipe(ROOT / RECIPE, budget[name])
            assert (r.train.steps, r.checkpoint.every, r.schedule.feedback_start_step) == (steps, steps // 5, start)
            assert (r.optimizer.lr, r.model.tie_embeddings, r.data.valid_sequences, r.eval.every) == (1e-3, False, 512, 200)
            assert r.feedback.fusion == ("glu" if name == two else "off"), name
        r = load_recipe(ROOT / RECIPE, budget[two])
        assert (r.schedule.mix, r.optimizer.fusion_lr_multiplier, r.feedback.loss_on) == ([0.5, 0.4, 0.1], 10.0, loss_on)
        # the study report pairs each FBT run with the untied standard run of its own steps
        kinds = dict.fromkeys(budget)
        assert same_change_baseline(two, kinds) == "untied_steps2400"
        assert same_change_baseline(f"{x10}{suffix}", kinds) == "untied"
        # without its own steps' standard run (--only, or not finished yet) the 2x run has no baseline
        assert same_change_baseline(two, {k: None for k in kinds if k != "standard_untied_steps2400"}) is None
        assert same_change_baseline(f"{x10}_additive{suffix}", dict.fromkeys(form)) == "untied"
        names[fbt_recipe] = {n for n in {**form, **budget} if "fbt" in n}
        # planned together, the groups agree on every shared run
        together = plan(["recipe", "form", "budget"], "tiny", False, 1200, 1e-3, fbt_recipe=fbt_recipe)
        assert together == {**e1, **plan(["form"], "tiny", False, 1200, 1e-3, fbt_recipe=fbt_recipe), **budget}
    # the FBT runs of two recipes never share a name (--reuse would let one stand in for the other)
    assert not (names["base"] & names["loss_mean"] or names["base"] & names["switch50"]
                or names["loss_mean"] & names["switch50"])
    with pytest.raises(ValueError, match="fbt_recipe"):
        plan(["form"], "tiny", False, fbt_recipe="mean")


PAST = "state accuracy past the layer count: "


def test_e2_rows_read_the_form_groups_runs(tmp_path, monkeypatch):
    """The summary's E2 rows from a hand-made medium report (recipe switch50): additive and GLU against the
    untied standard model and against each other (each FBT run in its best mode), and the additive model's
    state accuracy past the layer count against the standard model, its own 1 pass and the GLU's, and the
    GLU's against its 1 pass; pending without
    the report or without the additive run; the study's summary takes the new names."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    from feedback_study import plan, study_name

    from fbt_megatron.research.hypotheses import E1, HYPOTHESES, MEDIUM, Reports, row_cells
    from fbt_megatron.research.study import summarise

    # the reports the rows read are those of the documented commands
    assert (study_name("medium", 1200, 6e-4, False, False), study_name("tiny", 1200, 1e-3, False, False)) == (MEDIUM, E1)
    x10 = "fbt_heavy_untied_fusion_lr_x10"
    assert set(plan(["form"], "medium", False, 1200, 6e-4, fbt_recipe="switch50")) == {
        "standard_untied", f"{x10}_switch50", f"{x10}_additive_switch50", "state_standard_untied",
        f"state_{x10}_switch50", f"state_{x10}_additive_switch50"}

    def lm(p1, p2=None):
        return {"seq_length": 8, "val_loss": {"1": p1} if p2 is None else {"1": p1, "2": p2, "3": p2 + 0.01, "8": p2 + 0.02}}

    def st(**acc):  # 2 layers, 6 positions: positions 2..5 lie past the layer count
        return {"seq_length": 6, "num_layers": 2, "state_accuracy": {k.lstrip("p"): v for k, v in acc.items()}}

    readouts = {"standard_untied_seed1": lm(3.90), "standard_untied_seed2": lm(3.92),
                f"{x10}_switch50_seed1": lm(4.05, 4.00), f"{x10}_switch50_seed2": lm(4.06, 4.01),
                f"{x10}_additive_switch50_seed1": lm(3.95, 3.87), f"{x10}_additive_switch50_seed2": lm(3.96, 3.90),
                "state_standard_untied_seed1": st(p1=[1, 1, .2, .2, .2, .2]),
                "state_standard_untied_seed2": st(p1=[1, 1, .3, .1, .2, .2]),
                f"state_{x10}_switch50_seed1": st(p1=[1, 1, .2, .2, .2, .2], p6=[1, 1, .3, .3, .3, .3]),
                f"state_{x10}_switch50_seed2": st(p1=[1, 1, .2, .2, .2, .2], p6=[1, 1, .4, .4, .4, .4]),
                f"state_{x10}_additive_switch50_seed1": st(p1=[1, 1, .2, .2, .3, .3], p6=[1, 1, .6, .5, .4, .3]),
                f"state_{x10}_additive_switch50_seed2": st(p1=[1, 1, .2, .2, .2, .2], p6=[1, 1, .4, .4, .4, .4])}
    e2 = [h for h in HYPOTHESES if h.experiment.startswith("E2")]
    assert len(e2) == 7 and all(row_cells(h, Reports(tmp_path))[-1] == "not run yet" for h in e2)
    comparisons = summarise({n: {} for n in readouts}, readouts)
    assert comparisons[f"{x10}_additive_switch50"]["best mode"] == "2"
    assert comparisons[f"{x10}_additive_switch50"]["best mode - standard_untied (same change, equal tokens)"][2] == 2
    assert comparisons[f"state_{x10}_additive_switch50"][PAST + "exact - 1-pass (same model)"][2] == 2
    report = {"comparisons": comparisons, "readouts": readouts}
    (tmp_path / f"feedback_study_{MEDIUM}.json").write_text(json.dumps(report))
    rows = {h.claim: h.number(Reports(tmp_path)) for h in e2}
    # by hand: additive 2 passes 3.87 / 3.90, GLU 4.00 / 4.01, the standard model 3.90 / 3.92
    want = {"the additive fusion is ahead of the standard model at the medium size": (-0.03, -0.02),
            "the GLU fusion is ahead of the standard model at the medium size": (0.10, 0.09),
            "the additive fusion is ahead of the GLU": (-0.13, -0.11),
            # past L: additive exact .45 / .4, its 1 pass .25 / .2, the standard model .2 / .2
            "the additive model tracks the state past the layer count": (0.25, 0.2),
            "the additive model reads its fed-back state (the wide channel)": (0.2, 0.2),
            # the GLU's exact .3 / .4, its 1 pass .2 / .2
            "the GLU model reads its fed-back state": (0.1, 0.2),
            "the additive model tracks the state better than the GLU": (0.15, 0.0)}
    assert set(rows) == set(want)
    for claim, (a, b) in want.items():
        mean, err, n = rows[claim]
        assert (mean, err, n) == (pytest.approx((a + b) / 2), pytest.approx(abs(a - b) / 2, abs=1e-12), 2), claim
    # additive runs of two recipes in one report: refused, a row would not say which it read
    from fbt_megatron.errors import UserError

    two = {**report, "readouts": {**readouts, **{n.replace("switch50", "loss_mean"): r for n, r in readouts.items()
                                                 if "additive" in n}}}
    (tmp_path / f"feedback_study_{MEDIUM}.json").write_text(json.dumps(two))
    with pytest.raises(UserError, match="runs of 2 FBT recipes"):
        e2[0].number(Reports(tmp_path))
    # the additive run of no recipe: pending (the GLU and state runs alone decide nothing of E2)
    for name in [n for n in readouts if "additive" in n]:
        del report["readouts"][name]
    (tmp_path / f"feedback_study_{MEDIUM}.json").write_text(json.dumps(report))
    assert all(row_cells(h, Reports(tmp_path))[-1] == "not run yet" for h in e2)


def test_e3_rows_give_m_per_size_and_budget(tmp_path, monkeypatch):
    """m = D_standard(L_FBT) / D_FBT per seed from one report's budget runs: the standard model's final
    1-pass loss at 600, 1200 and 2400 steps (linear in log tokens between them, extended past the ends),
    FBT's best mode at 1x and 2x, with the recipe of the 2x run (E1's report holds every recipe at 1x), else
    of the 1x run; a seed's m waits for the standard runs that fix it: all three, or 0.5x and 1x bracketing it."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    from feedback_study import plan

    from fbt_megatron.research.hypotheses import E1, HYPOTHESES, MEDIUM, Reports, row_cells

    x10, two = "fbt_heavy_untied_fusion_lr_x10", "fbt_heavy_untied_steps2400_fusion_lr_x10"
    std = {600: "standard_untied_steps600", 1200: "standard_untied", 2400: "standard_untied_steps2400"}
    assert set(plan(["budget"], "tiny", False, 1200, 1e-3, fbt_recipe="loss_mean")) == {
        *std.values(), f"{x10}_loss_mean", f"{two}_loss_mean"}
    standard = {1: {600: 4.30, 1200: 4.10, 2400: 3.95}, 2: {600: 4.40, 1200: 4.20, 2400: 4.00}}
    fbt = {1: {1: 4.20, 2: 4.00}, 2: {1: 4.20, 2: 3.90}}  # best mode (2 passes), at 1x and 2x
    # by hand, D in steps (the tokens a step cancel): seed 1, 1x: 4.20 halfway from 4.30 (600) to 4.10 (1200)
    # in log D: D = 600 * 2^0.5, m = 600 * 2^0.5 / 1200; 2x: 4.00 two thirds from 4.10 (1200) to 3.95 (2400):
    # D = 1200 * 2^(2/3), m = D / 2400. Seed 2, 1x: the 1200-step standard loss itself, m = 1; 2x: 3.90 is
    # 1.5 segments past 4.20 (1200) on the last segment's slope (-0.2 per doubling): D = 1200 * 2^1.5.
    m = {1: {1: 2 ** 0.5 / 2, 2: 2 ** (2 / 3) / 2}, 2: {1: 1.0, 2: 2 ** 1.5 / 2}}

    def report(suffix):
        readouts = {f"{std[n]}_seed{s}": {"seq_length": 128, "val_loss": {"1": loss}}
                    for s, losses in standard.items() for n, loss in losses.items()}
        for s, losses in fbt.items():
            for f, kind in ((1, f"{x10}{suffix}"), (2, f"{two}{suffix}")):
                readouts[f"{kind}_seed{s}"] = {"seq_length": 128, "val_loss": {"1": losses[f] + 0.1, "2": losses[f]}}
            # E1's other recipes at 1x, far off: not E3's (no 2x run)
            for other in {"", "_loss_mean", "_switch50"} - {suffix}:
                readouts[f"{x10}{other}_seed{s}"] = {"seq_length": 128, "val_loss": {"1": 9.0, "2": 9.0}}
        best = {k: {"best mode": "2"} for k in {n.rpartition("_seed")[0] for n in readouts} if "fbt" in k}
        return {"comparisons": best, "readouts": readouts}

    e3 = {h.claim: h for h in HYPOTHESES if h.experiment.startswith("E3") and h.measure == "token multiplier m"}
    assert len(e3) == 4 and all(row_cells(h, Reports(tmp_path))[-1] == "not run yet" for h in e3.values())
    for stem, size, suffix in ((E1, "tiny", "_loss_mean"), (MEDIUM, "medium", "")):
        (tmp_path / f"feedback_study_{stem}.json").write_text(json.dumps(report(suffix)))
        for factor in (1, 2):
            (claim,) = [c for c in e3 if c.startswith(f"m > 1 at the {size} size, {factor}×")]
            mean, err, n = e3[claim].number(Reports(tmp_path))
            a, b = m[1][factor], m[2][factor]
            assert (mean, err, n) == (pytest.approx((a + b) / 2), pytest.approx(abs(a - b) / 2), 2), claim
    cells = row_cells(e3["m > 1 at the tiny size, 2× the budget (2400 steps, 4.9 M tokens)"], Reports(tmp_path))
    assert cells[4].startswith(f"{(m[1][2] + m[2][2]) / 2:.2f}× [") and cells[5] == "2"
    # seed 2's 600-step run missing: no m for seed 2, though its 1200- and 2400-step losses bracket its 1x
    # loss: without the 600-step run, which segment brackets it first is not known
    medium = tmp_path / f"feedback_study_{MEDIUM}.json"

    def drop(*names):
        data = json.loads(medium.read_text())
        for name in names:
            del data["readouts"][name]
        medium.write_text(json.dumps(data))
        return [e3[f"m > 1 at the medium size, {f}× the budget ({s} steps, {t} M tokens)"].number(Reports(tmp_path))
                for f, s, t in ((1, 1200, 2.5), (2, 2400, 4.9))]

    seed1 = [(pytest.approx(m[1][f]), 1) for f in (1, 2)]
    assert [(g[0], g[2]) for g in drop(f"{std[600]}_seed2")] == seed1
    # seed 1's 2400-step run missing: m at 1x stays (its 600- and 1200-step losses bracket 4.20); none at 2x
    got = drop(f"{std[2400]}_seed1")
    assert (got[0][0], got[0][2]) == seed1[0] and got[1] is None
    # without the 2x runs, the report holds three recipes at 1x: no row says which one it read
    assert drop(f"{two}_seed1", f"{two}_seed2") == [None, None]
    # one recipe's 1x runs alone (E2's at the medium size) give m at 1x; without the 1200-step run, none
    got = drop(*(f"{x10}{o}_seed{s}" for o in ("_loss_mean", "_switch50") for s in (1, 2)))
    assert (got[0][0], got[0][2]) == seed1[0] and got[1] is None
    assert drop(f"{std[1200]}_seed1") == [None, None]


def test_validation_text_names_the_read_outs_set_and_is_empty_without_language_runs():
    from fbt_megatron.research.study import validation_text

    assert validation_text({"state_fbt_seed1": {"state_accuracy": {"1": [1.0]}}}) == ""
    held = {"validation": "held_out", "val_loss": {"1": 3.0}, "validation_tokens": {"code": 10, "math": 2}}
    assert "(code 10, math 2 tokens)" in validation_text({"a_seed1": held, "b_seed1": held})
    assert validation_text({"a_seed1": {"val_loss": {"1": 3.0}}}).startswith("Validation on held-out documents")
    assert "Read the runs out again" in validation_text({"a_seed1": held, "b_seed1": {"val_loss": {"1": 3.0}}})


def test_every_fbt_run_keeps_the_loss_rule_its_name_says(monkeypatch):
    """The research recipe's default is ``loss_on: mean`` (E1); the study's FBT runs that name no rule were
    all trained with the loss on the last pass, and are planned so in every group, scale and protocol: only
    the ``_loss_mean`` runs average the passes. Standard runs get no loss rule (their commands stay as they
    were, so their unfinished folders resume)."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    from feedback_study import FBT_RECIPES, GROUPS, RECIPE, plan

    from fbt_megatron.recipe import load_recipe

    assert load_recipe(ROOT / RECIPE).feedback.loss_on == "mean"
    seen = set()
    for scale, lr, shared, fbt_recipe in (("tiny", None, True, "base"), ("medium", 6e-4, False, "loss_mean"),
                                          ("tiny", 1e-3, False, "switch50")):
        assert fbt_recipe in FBT_RECIPES
        for name, overrides in plan(list(GROUPS), scale, False, 1200, lr, shared, fbt_recipe).items():
            if "feedback.fusion=off" in overrides:
                assert not any(o.startswith("feedback.loss_on=") for o in overrides), name
                continue
            want = "mean" if name.endswith("_loss_mean") else "last"
            assert load_recipe(ROOT / RECIPE, overrides).feedback.loss_on == want, name
            seen.add(want)
    assert seen == {"mean", "last"}


def test_multiplier_table_gives_m_per_seed_for_each_size_and_budget(tmp_path):
    """The token multiplier's table: the earlier tiny budgets, then E3's 1x and 2x at each size with the FBT
    recipe of its runs, each seed's m at FBT's best mode (by hand from the formula), the seeds, and the mean
    with its t-interval (t(0.975, 1) = 12.706); budgets without runs say so."""
    from fbt_megatron.research.hypotheses import E1, MEDIUM, Reports, multiplier_table

    x10, two = "fbt_heavy_untied_fusion_lr_x10_loss_mean", "fbt_heavy_untied_steps2400_fusion_lr_x10_loss_mean"
    standard = {1: (4.3, 4.1, 3.9), 3: (4.4, 4.2, 4.0)}  # 600, 1200, 2400 steps
    fbt = {1: (4.2, 3.95), 3: (4.25, 4.15)}  # the best mode (2 passes) at 1x and 2x; 1 pass 0.3 worse
    readouts = {}
    for seed in standard:
        for kind, loss in zip(("standard_untied_steps600", "standard_untied", "standard_untied_steps2400"),
                              standard[seed]):
            readouts[f"{kind}_seed{seed}"] = {"seq_length": 128, "val_loss": {"1": loss}}
        for kind, loss in zip((x10, two), fbt[seed]):
            readouts[f"{kind}_seed{seed}"] = {"seq_length": 128, "val_loss": {"1": loss + 0.3, "2": loss}}
    report = {"comparisons": {x10: {"best mode": "2"}, two: {"best mode": "2"}}, "readouts": readouts}
    (tmp_path / f"feedback_study_{E1}.json").write_text(json.dumps(report))
    text = multiplier_table(Reports(tmp_path))
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): line for line in text.splitlines()[2:]}
    # seed 1: 4.2 halfway (in log tokens) from 600 to 1200 steps, m = 600 * 2^0.5 / 1200; 3.95 three quarters
    # from 1200 to 2400, m = 1200 * 2^0.75 / 2400. Seed 3: 4.25 three quarters from 600 to 1200, m = 2^0.75 / 2;
    # 4.15 a quarter from 1200 to 2400, m = 2^0.25 / 2.
    m = {1200: (2 ** 0.5 / 2, 2 ** 0.75 / 2), 2400: (2 ** 0.75 / 2, 2 ** 0.25 / 2)}
    for steps, (m1, m3) in m.items():
        mean, half = (m1 + m3) / 2, 12.706 * abs(m1 - m3) / 2
        cells = [c.strip() for c in rows[("E3: tiny, 1e-3, loss_on: mean", f"{steps} ({steps * 2048 / 1e6:.2f} M)")]
                 .strip("|").split("|")]
        assert cells[2:] == [f"{m1:.2f}× / {m3:.2f}×", "1, 3", f"{mean:.2f}× [{mean - half:.2f}, {mean + half:.2f}]"], cells
    for steps in ("1200 (2.46 M)", "2400 (4.92 M)"):
        assert "not run yet" in rows[("E3: medium, 6e-4", steps)]
    assert all("not run yet" in rows[("tiny, 3e-3, one data order", f"{s} ({s * 2048 / 1e6:.2f} M)")]
               for s in (600, 1200, 2400))


def test_e3_budget_waiting_for_standard_runs_says_so(tmp_path):
    """A budget whose FBT run is read out but whose seeds' m still need standard runs names those seeds in
    the summary row and the multiplier table instead of "not run yet", which stays for a budget with no FBT
    run."""
    from fbt_megatron.research.hypotheses import HYPOTHESES, MEDIUM, Reports, multiplier_table, row_cells

    one, two = "fbt_heavy_untied_fusion_lr_x10_loss_mean", "fbt_heavy_untied_steps2400_fusion_lr_x10_loss_mean"
    readouts = {"standard_untied_steps600_seed1": {"seq_length": 128, "val_loss": {"1": 4.3}},
                "standard_untied_seed1": {"seq_length": 128, "val_loss": {"1": 4.1}},
                f"{one}_seed1": {"seq_length": 128, "val_loss": {"1": 4.2}}}
    path = tmp_path / f"feedback_study_{MEDIUM}.json"
    rows = {h.claim: h for h in HYPOTHESES if h.experiment.startswith("E3") or "medium size, 1×" in h.claim}
    at_2x = rows["m > 1 at the medium size, 2× the budget (2400 steps, 4.9 M tokens)"]
    table_row = "| E3: medium, 6e-4, loss_on: mean | 2400 (4.92 M) |"
    for fbt_2x, want in (((), "not run yet"), ((1, 2), "waits for standard runs (FBT: seeds 1, 2)")):
        with_2x = dict(readouts, **{f"{two}_seed{s}": {"seq_length": 128, "val_loss": {"1": 3.9}} for s in fbt_2x})
        best = {k: {"best mode": "1"} for k in {n.rpartition("_seed")[0] for n in with_2x} if "fbt" in k}
        path.write_text(json.dumps({"comparisons": best, "readouts": with_2x}))
        assert row_cells(at_2x, Reports(tmp_path))[-1] == want
        (line,) = [r for r in multiplier_table(Reports(tmp_path)).splitlines() if r.startswith(table_row)]
        assert f"| {want} |" in line, line
    # the 1x budget has its m (bracketed by 600 and 1200 steps: halfway, 2^0.5 / 2), not a waiting note
    assert row_cells(rows["m > 1 at the medium size, 1× the budget (1200 steps, 2.5 M tokens)"],
                     Reports(tmp_path))[4] == f"{2 ** 0.5 / 2:.2f}×"
    # 1x: an FBT run of seed 3 with only its 1x standard run (no 0.5x run to bracket it) waits; 2x not run
    alone = {f"{one}_seed3": {"seq_length": 128, "val_loss": {"1": 4.2}},
             "standard_untied_seed3": {"seq_length": 128, "val_loss": {"1": 4.1}}}
    path.write_text(json.dumps({"comparisons": {one: {"best mode": "1"}}, "readouts": alone}))
    at_1x = rows["m > 1 at the medium size, 1× the budget (1200 steps, 2.5 M tokens)"]
    assert row_cells(at_1x, Reports(tmp_path))[-1] == "waits for standard runs (FBT: seed 3)"
    assert row_cells(at_2x, Reports(tmp_path))[-1] == "not run yet"


def test_e3_trend_rows_pair_budgets_by_seed_and_compare_sizes_as_independent_means(tmp_path):
    """The trend of m: with the budget, m at 2x - m at 1x paired by seed (t-interval, df = seeds - 1); with
    size, the medium size's mean m - the tiny size's, standard errors in quadrature and df = the fewer seeds - 1.
    Each seed's m by hand from the formula; a row without its number names the runs it waits for."""
    from scipy.stats import t as student_t

    from fbt_megatron.research.hypotheses import E1, HYPOTHESES, MEDIUM, Reports, row_cells

    one, two = "fbt_heavy_untied_fusion_lr_x10_loss_mean", "fbt_heavy_untied_steps2400_fusion_lr_x10_loss_mean"
    standard = (4.3, 4.1, 3.9)  # 600, 1200, 2400 steps, every seed: -0.2 per doubling of the tokens
    # FBT's best mode (1 pass) at 1x and 2x. At 1x, L lies between 600 and 1200 steps: D = 600 * 2^((4.3 - L)
    # / 0.2) steps, m = D / 1200; at 2x, between 1200 and 2400: D = 1200 * 2^((4.1 - L) / 0.2), m = D / 2400.
    # The medium size's seed 3 has no 2x run: it counts at 1x only.
    fbt = {E1: {1: (4.2, 4.0), 2: (4.25, 4.0), 3: (4.15, 4.01)},
           MEDIUM: {1: (4.25, 3.95), 2: (4.25, 3.951), 3: (4.2, None)}}
    m = {stem: {s: (2 ** ((4.3 - a) / 0.2) / 2, None if b is None else 2 ** ((4.1 - b) / 0.2) / 2)
                for s, (a, b) in seeds.items()} for stem, seeds in fbt.items()}

    def write(stem, seeds):
        readouts = {}
        for seed, losses in seeds.items():
            for kind, loss in zip(("standard_untied_steps600", "standard_untied", "standard_untied_steps2400"),
                                  standard):
                readouts[f"{kind}_seed{seed}"] = {"seq_length": 128, "val_loss": {"1": loss}}
            for kind, loss in zip((one, two), losses):
                if loss is not None:
                    readouts[f"{kind}_seed{seed}"] = {"seq_length": 128, "val_loss": {"1": loss, "2": loss + 0.1}}
        report = {"comparisons": {one: {"best mode": "1"}, two: {"best mode": "1"}}, "readouts": readouts}
        (tmp_path / f"feedback_study_{stem}.json").write_text(json.dumps(report))
        return readouts

    for stem, seeds in fbt.items():
        write(stem, seeds)
    rows = {h.claim: h for h in HYPOTHESES}

    def text(mean, half):
        return f"{mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}]"

    for stem, size, call in ((E1, "tiny", "undecided at this scale"), (MEDIUM, "medium", "supported")):
        d = [m2 - m1 for m1, m2 in m[stem].values() if m2 is not None]
        half = student_t.ppf(0.975, len(d) - 1) * statistics.stdev(d) / len(d) ** 0.5
        cells = row_cells(rows[f"m grows with the budget at the {size} size (1× to 2×)"], Reports(tmp_path))
        assert cells[4:] == [text(statistics.fmean(d), half), str(len(d)), call], cells
    for factor, seeds, call in ((1, 3, "undecided at this scale"), (2, 2, "supported")):
        means, errors = [], []
        for stem in (E1, MEDIUM):
            v = [pair[factor - 1] for pair in m[stem].values() if pair[factor - 1] is not None]
            means.append(statistics.fmean(v))
            errors.append(statistics.stdev(v) / len(v) ** 0.5)
        want = text(means[1] - means[0], student_t.ppf(0.975, seeds - 1) * math.hypot(*errors))
        cells = row_cells(rows[f"m grows with size (tiny to medium) at {factor}× the budget"], Reports(tmp_path))
        assert cells[4:] == [want, str(seeds), call], cells
    # the medium size's 2x run of seed 2 gone: one seed at 2x there, a difference without an interval
    write(MEDIUM, {1: fbt[MEDIUM][1], 2: (4.25, None), 3: (4.2, None)})
    tiny_2x = statistics.fmean(pair[1] for pair in m[E1].values())
    cells = row_cells(rows["m grows with size (tiny to medium) at 2× the budget"], Reports(tmp_path))
    assert cells[4:] == [f"{m[MEDIUM][1][1] - tiny_2x:+.3f}", "1", "undecided (one seed)"], cells
    # the medium 2x run waiting for its seed's 2400-step standard run (its loss lies below 1200 steps'): named
    readouts = write(MEDIUM, {1: fbt[MEDIUM][1]})
    del readouts["standard_untied_steps2400_seed1"]
    (tmp_path / f"feedback_study_{MEDIUM}.json").write_text(json.dumps(
        {"comparisons": {one: {"best mode": "1"}, two: {"best mode": "1"}}, "readouts": readouts}))
    waiting = "medium 2×: waits for standard runs (FBT: seed 1)"
    assert row_cells(rows["m grows with the budget at the medium size (1× to 2×)"], Reports(tmp_path))[-1] == waiting
    assert row_cells(rows["m grows with size (tiny to medium) at 2× the budget"], Reports(tmp_path))[-1] == waiting
    # no 1x FBT run, the 2x one waiting: the row names the waiting budget, not the first one lacking m
    readouts = write(MEDIUM, {1: (None, 3.95)})
    del readouts["standard_untied_steps2400_seed1"]
    (tmp_path / f"feedback_study_{MEDIUM}.json").write_text(json.dumps({"comparisons": {}, "readouts": readouts}))
    assert row_cells(rows["m grows with the budget at the medium size (1× to 2×)"], Reports(tmp_path))[-1] == waiting
    # m at 1x only, no 2x FBT run: the row names the budget not run
    write(MEDIUM, {1: (4.25, None), 2: (4.25, None)})
    assert row_cells(rows["m grows with the budget at the medium size (1× to 2×)"],
                     Reports(tmp_path))[-1] == "medium 2×: not run yet"
    # m at 1x for seed 1 only and at 2x for seed 2 only: no seed to pair
    write(MEDIUM, {1: (4.25, None), 2: (None, 3.95)})
    assert row_cells(rows["m grows with the budget at the medium size (1× to 2×)"],
                     Reports(tmp_path))[-1] == "no seed has m at both budgets yet"
    # the medium report gone: no size trend (not a comparison with nothing); it names the size not run
    (tmp_path / f"feedback_study_{MEDIUM}.json").unlink()
    assert row_cells(rows["m grows with size (tiny to medium) at 1× the budget"],
                     Reports(tmp_path))[-1] == "medium 1×: not run yet"
    (tmp_path / f"feedback_study_{E1}.json").unlink()
    assert row_cells(rows["m grows with size (tiny to medium) at 1× the budget"], Reports(tmp_path))[-1] == "not run yet"
