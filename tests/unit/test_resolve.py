"""A run is resolved once, before launch: recipe + world size + environment -> the run plan, with every
problem at once; `fbt train --dry-run` prints it and writes nothing; `fbt slurm submit` queues nothing that
the plan refuses."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml

from fbt_megatron.recipe import RecipeError, load_recipe
from fbt_megatron.resolve.plan import Environment, PlanError
from fbt_megatron.resolve.resolver import resolve_run

ROOT = Path(__file__).resolve().parents[2]
CPU = Environment("cpu", "fp32")


def _tree(root: Path) -> dict[str, tuple[int, float]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime) for p in root.rglob("*")}


def _no_process_group(monkeypatch):
    """torch.distributed refuses every call: the plan must need none of them."""
    def refuse(*a, **k):
        raise AssertionError("the run plan called torch.distributed")

    for name in ("init_process_group", "get_rank", "get_world_size", "barrier", "broadcast_object_list"):
        monkeypatch.setattr(dist, name, refuse)


def test_the_plan_is_built_without_a_process_group_or_megatron_state(monkeypatch, tmp_path):
    _no_process_group(monkeypatch)
    recipe = load_recipe(ROOT / "recipes" / "tiny.yaml", [f"run_dir={tmp_path / 'run'}", "parallel.tensor=2",
                                                          "parallel.zero_stage=2", "precision=bf16",
                                                          "batch.micro_batch_size=4"])
    plan = resolve_run(recipe, 4, CPU)
    assert not dist.is_initialized()
    ps = sys.modules.get("megatron.core.parallel_state")
    assert ps is None or not ps.model_parallel_is_initialized()
    # derived from the formulas: DP = 4 processes / TP 2; micro-batches = global 16 / (micro 4 x DP 2)
    assert (plan.layout.tensor, plan.layout.data) == (2, 2)
    assert plan.micro_batches_per_step == 2
    assert plan.precision == "bf16" and plan.feedback_depth == 3 and plan.eval_passes == (1, 3)
    assert any("zero_stage=2 with bf16" in w for w in plan.warnings)
    assert plan.data.build_embedded == "data/embedded"
    assert [s["weight"] for s in plan.data.config["sources"]] == [0.4, 0.3, 0.3]
    assert plan.resume.checkpoint is None and recipe.parallel.tensor == 2  # the recipe itself is not changed


def test_independent_mistakes_are_reported_at_once(tmp_path):
    """A layout the process count cannot hold, a missing tokenizer, a missing dataset directory, and a new
    run on a used run directory: one error, four lines, each naming its recipe key."""
    used = tmp_path / "run" / "checkpoints"
    (used / "step_00000002").mkdir(parents=True)
    recipe = load_recipe(data={
        "run_dir": str(tmp_path / "run"), "parallel": {"tensor": 2}, "checkpoint": {"resume": False},
        "data": {"source": "pipeline", "pipeline": {"tokenizer": str(tmp_path / "nowhere.model"),
                                                    "sources": [{"name": "a", "path": str(tmp_path / "a"),
                                                                 "weight": 1.0}]}}})
    with pytest.raises(PlanError) as e:
        resolve_run(recipe, 3, CPU)
    problems = e.value.problems
    assert len(problems) == 4, problems
    assert problems[0].startswith("recipe key 'parallel.tensor': tensor=2 x pipeline=1 does not divide the process "
                                  "count 3")
    assert problems[1].startswith("recipe key 'data.pipeline.tokenizer': tokenizer model not found")
    assert problems[2].startswith("recipe key 'data.pipeline.sources[0].path': the dataset directory")
    assert problems[3].startswith("recipe key 'checkpoint.resume': checkpoint.resume=false, but")
    assert str(e.value).startswith("invalid run plan (4 errors):\n  recipe key 'parallel.tensor'")
    assert isinstance(e.value, RecipeError)


def test_the_recipes_own_cross_section_checks_report_every_problem():
    with pytest.raises(RecipeError) as e:
        load_recipe(data={"parallel": {"pipeline": 3}, "data": {"seq_length": 4096},
                          "batch": {"global_batch_size": 10, "micro_batch_size": 4}})
    lines = str(e.value).splitlines()
    assert lines[0] == "invalid recipe:" and len(lines) == 4, lines
    assert [line.split("=")[0].strip() for line in lines[1:]] == ["batch.global_batch_size", "data.seq_length",
                                                                  "parallel.pipeline"]


def test_the_plan_names_the_checkpoint_it_resumes_and_the_rule_it_adopts(tmp_path):
    step = tmp_path / "run" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step.parent / "latest").write_text("step_00000004\n")
    (step / "state.json").write_text(json.dumps({"recipe": {"feedback": {"first_input": "state"}}}))
    plan = resolve_run(load_recipe(data={"run_dir": str(tmp_path / "run")}), 1, CPU)
    assert plan.resume.checkpoint == step and plan.resume.adopted == ("feedback.first_input='state'",)
    assert plan.recipe.feedback.first_input == "state"
    assert any("feedback.first_input='state'" in w for w in plan.warnings)
    with pytest.raises(PlanError, match=r"recipe key 'feedback.first_input': the checkpoint .* was trained with"):
        resolve_run(load_recipe(data={"run_dir": str(tmp_path / "run"),
                                      "feedback": {"first_input": "embedding"}}), 1, CPU)


def test_a_new_run_refuses_a_run_dir_holding_the_users_files_under_the_names_it_writes(tmp_path):
    """A new run rewrites summary.json and metrics.jsonl in its run_dir: files of those names that fbt train
    did not write are one plan problem naming them, and stay as they were; other files do not matter."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text('{"accuracy": 0.91}\n')
    (run / "metrics.jsonl").write_text('{"epoch": 1, "loss": 2.5}\n{"epoch": 2, "loss": 2.1}\n')
    (run / "notes.txt").write_text("mine\n")
    before = _tree(run)
    with pytest.raises(PlanError) as e:
        resolve_run(load_recipe(data={"run_dir": str(run)}), 1, CPU)
    assert e.value.problems == [f"recipe key 'run_dir': {run} holds metrics.jsonl and summary.json, which fbt "
                                "train did not write: nothing was changed; choose a new run_dir, or move them away"]
    assert _tree(run) == before
    # one of them alone is named alone; a summary of another shape, or unreadable, is not fbt train's either
    (run / "metrics.jsonl").unlink()
    for text in ('{"accuracy": 0.91}', '[1, 2]', 'not json', '{"run_dir": "x", "step": 3}'):
        (run / "summary.json").write_text(text)
        with pytest.raises(PlanError, match=r"holds summary.json, which fbt train did not write"):
            resolve_run(load_recipe(data={"run_dir": str(run)}), 1, CPU)


@pytest.mark.parametrize("metrics", [
    '{"step": 1, "passes": 1, "loss": 5.1, "data_checksum": 7, "time": 1.0}\n',  # a step's row
    '{"event": "metrics", "step": 0, "tokens_seen": 0, "time": 1.0, "val/loss_k1": 5.2}\n{"step": 1, "time": 2}\n',
    '',  # created, nothing written yet
    '{"step": 1, "passes": 1, "lo',  # its first write cut by a kill
], ids=["step_row", "event_row", "empty", "cut"])
def test_a_new_run_takes_an_earlier_runs_files_in_its_run_dir_for_its_own(tmp_path, metrics):
    """An earlier run that stopped before its first checkpoint left summary.json and metrics.jsonl (every row
    has its step and time; a step's row its data checksum, an event's row its event): a new run there goes
    ahead (it replaces them), as it does after a resume's checkpoints were deleted."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"name": "tiny", "run_dir": str(run), "step": 3, "total_steps": 8,
                                                 "pass_counts": {"1": 3}, "stop_reason": None}))
    (run / "metrics.jsonl").write_text(metrics)
    plan = resolve_run(load_recipe(data={"run_dir": str(run)}), 1, CPU)
    assert plan.resume.checkpoint is None


def test_a_resumed_run_does_not_read_its_run_dirs_files(tmp_path):
    """A run that resumes its own checkpoint wrote its run_dir: nothing there is checked."""
    step = tmp_path / "run" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step.parent / "latest").write_text("step_00000004\n")
    (step / "state.json").write_text(json.dumps({"recipe": {}, "train_state": {"step": 4}}))
    (tmp_path / "run" / "metrics.jsonl").write_text("not what fbt train writes\n")
    assert resolve_run(load_recipe(data={"run_dir": str(tmp_path / "run")}), 1, CPU).resume.checkpoint == step


@pytest.mark.slow  # two fbt train subprocesses (~30 s)
def test_a_real_runs_files_are_taken_for_its_own_by_a_new_run(tmp_path):
    """What fbt train really writes is what the plan recognises: a run whose checkpoints were deleted starts
    afresh in its folder. Before that, resuming it with another model is refused in one sentence."""
    import subprocess

    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "fbt_megatron.cli", "train", str(ROOT / "recipes" / "tiny.yaml"),
                        f"run_dir={run}", "train.steps=2", "eval.every=1", "logging.tensorboard=false"],
                       cwd=ROOT, capture_output=True, text=True, env={**os.environ, "FBT_DEVICE": "cpu"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert (run / "summary.json").is_file() and (run / "metrics.jsonl").stat().st_size > 0
    # resumed with another model: the plan says so in one sentence, with what to do
    r = subprocess.run([sys.executable, "-m", "fbt_megatron.cli", "train", str(ROOT / "recipes" / "tiny.yaml"),
                        f"run_dir={run}", "train.steps=3", "model.hidden_size=64", "logging.tensorboard=false"],
                       cwd=ROOT, capture_output=True, text=True, env={**os.environ, "FBT_DEVICE": "cpu"})
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith(
        "was trained with another network (model.hidden_size: 128 there, 64 here), and a run resumes only with its "
        "own; set model.hidden_size=128 to continue it, or use a new run_dir"), r.stderr[-2000:]
    shutil.rmtree(run / "checkpoints")
    plan = resolve_run(load_recipe(ROOT / "recipes" / "tiny.yaml", [f"run_dir={run}"]), 1, CPU)
    assert plan.resume.checkpoint is None


def test_the_plan_counts_the_steps_this_invocation_trains_from_the_resumed_step(tmp_path, monkeypatch, capsys):
    """A run resumed at step 4 of 8 trains 4 steps; at step 8 of 8 none, and the plan warns (dry run) and
    fbt slurm submit refuses to queue a job that would train nothing, before any sbatch; with --phases a
    first phase already done is left out and the second submitted alone. The advice names the limit that
    stops the run: train.stop_at_step when it is the one."""
    from fbt_megatron.cli import main

    step = tmp_path / "run" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step.parent / "latest").write_text("step_00000004\n")
    (step / "state.json").write_text(json.dumps({"recipe": {}, "train_state": {"step": 4}}))
    data = {"run_dir": str(tmp_path / "run"), "train": {"steps": 8}, "schedule": {"feedback_start_step": 4}}
    plan = resolve_run(load_recipe(data=data), 1, CPU)
    assert plan.derived()["steps"] == {"total": 8, "resumed_at": 4, "stops_at": 8, "this_invocation": 4}
    assert not any("nothing to train" in w for w in plan.warnings)
    assert resolve_run(load_recipe(data={**data, "run_dir": str(tmp_path / "new")}), 1, CPU).derived()["steps"] == \
        {"total": 8, "resumed_at": 0, "stops_at": 8, "this_invocation": 8}
    data["train"] = {"steps": 8, "stop_at_step": 3}
    plan = resolve_run(load_recipe(data=data), 1, CPU)
    assert plan.derived()["steps"] == {"total": 8, "resumed_at": 4, "stops_at": 3, "this_invocation": 0}
    assert f"{tmp_path / 'run'} is already at step 4, at or past train.stop_at_step=3: nothing to train (raise or " \
           "remove train.stop_at_step)" in plan.warnings

    (step.parent / "step_00000008").mkdir()
    (step.parent / "step_00000008" / "state.json").write_text(json.dumps({"recipe": {}, "train_state": {"step": 8}}))
    (step.parent / "latest").write_text("step_00000008\n")
    recipe = str(ROOT / "recipes" / "tiny.yaml")
    args = [f"run_dir={tmp_path / 'run'}", "train.steps=8", "schedule.feedback_start_step=4"]
    assert main(["train", recipe, *args, "--dry-run"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)["resolved"]
    assert printed["steps"]["this_invocation"] == 0 and any("nothing to train" in w for w in printed["warnings"])
    bin_dir, calls = tmp_path / "bin", tmp_path / "sbatch-calls"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(FAKE_SBATCH.format(calls=calls))
    (bin_dir / "squeue").write_text("#!/bin/sh\n")  # the submitted jobs are over
    for tool in ("sbatch", "squeue"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for phases in ([], ["--phases"]):  # the whole run is done: no job is queued, the second phase's neither
        assert main(["slurm", "submit", recipe, "--cpu", "--gpus-per-node", "1", *phases, *args]) == 2
        assert capsys.readouterr().err.endswith(
            "is already at step 8 of 8: nothing to train (raise train.steps to continue, or use a new run_dir); "
            "nothing was submitted\n")
        assert not calls.exists()
    (step.parent / "latest").write_text("step_00000004\n")  # between the phases: the first is done
    assert main(["slurm", "submit", recipe, "--cpu", "--gpus-per-node", "1", "--phases", *args]) == 0
    out = capsys.readouterr().out
    assert (f"phase 1 is done: {tmp_path / 'run'} is at step 4, at or past the feedback switch at step 4; submitting "
            "phase 2 alone") in out and "submitted tiny-p2: job 4242" in out
    assert len(calls.read_text().splitlines()) == 1 and "afterok" not in calls.read_text()
    (step.parent / "latest").write_text("step_00000008\n")
    assert main(["slurm", "submit", recipe, "--cpu", "--gpus-per-node", "1", *args, "train.steps=12"]) == 0
    assert len(calls.read_text().splitlines()) == 2  # raised train.steps: it trains on


def test_a_recipe_that_continues_a_checkpoint_is_refused_without_one(tmp_path, monkeypatch):
    """checkpoint.resume: required (fbt convert from-hf's recipes) never starts a fresh model: a relative
    run_dir missing here says where to run from; an existing or absolute one without ``latest`` names the
    missing file; both say how to start a new run from saved weights instead."""
    monkeypatch.chdir(tmp_path)
    new_run = "for a new run from a checkpoint's weights, add init_from=CHECKPOINT checkpoint.resume=true"

    def refusal(run_dir) -> str:
        with pytest.raises(PlanError) as e:
            resolve_run(load_recipe(data={"run_dir": run_dir, "checkpoint": {"resume": "required"}}), 1, CPU)
        return str(e.value)

    assert refusal("runs/imported") == (
        f"recipe key 'checkpoint.resume': the recipe continues a checkpoint, but runs/imported does not exist in "
        f"{tmp_path}: run it from the directory that holds runs/imported, or set run_dir to its full path; {new_run}")
    (tmp_path / "runs" / "emptied" / "checkpoints" / "step_00000004").mkdir(parents=True)  # no `latest`
    assert refusal("runs/emptied") == (f"recipe key 'checkpoint.resume': the recipe continues a checkpoint, but "
                                       f"runs/emptied/checkpoints/latest does not exist; {new_run}")
    assert refusal(str(tmp_path / "gone")) == (f"recipe key 'checkpoint.resume': the recipe continues a checkpoint, "
                                               f"but {tmp_path / 'gone'}/checkpoints/latest does not exist; {new_run}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # nothing written
    assert resolve_run(load_recipe(data={"run_dir": "runs/new"}), 1, CPU).resume.checkpoint is None  # true: a new run
    with pytest.raises(RecipeError, match=r"recipe key 'checkpoint.resume': must be true, false or required, not "
                                          r"'Required'"):
        load_recipe(data={"checkpoint": {"resume": "Required"}})
    assert load_recipe(data={}, overrides=["checkpoint.resume=yes"]).checkpoint.resume is True


def test_a_resume_with_another_network_is_refused_by_the_plan_naming_every_key(tmp_path):
    """The checkpoint was trained with 4 layers of width 128 and the GLU fusion: a recipe that changes any of
    them is refused before launch, every changed key named with both values; dropout, recomputation and the
    init may change, and an unset MLP width or group count equals its value written out. (Before, a changed
    width failed at start-up, after the queue; a changed fusion or head count resumed silently into another
    model.)"""
    step = tmp_path / "run" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step.parent / "latest").write_text("step_00000004\n")
    trained = load_recipe(data={"model": {"num_layers": 4, "hidden_size": 128}, "feedback": {"fusion": "glu"}})
    (step / "state.json").write_text(json.dumps({"recipe": trained.model_dump(mode="json"),
                                                 "train_state": {"step": 4}}))
    run = {"run_dir": str(tmp_path / "run"), "model": {"num_layers": 4, "hidden_size": 128}, "train": {"steps": 8}}
    ok = {**run, "model": {**run["model"], "hidden_dropout": 0.1, "recompute": "full", "init_method_std": 0.01,
                           "ffn_hidden_size": 512, "num_query_groups": 4}}  # what unset means: 4 x 128, a group a head
    assert resolve_run(load_recipe(data=ok), 1, CPU).resume.step == 4
    changed = {**run, "model": {"num_layers": 2, "hidden_size": 128, "num_attention_heads": 8,
                                "ffn_hidden_size": 256}}
    with pytest.raises(PlanError) as e:
        resolve_run(load_recipe(data=changed), 1, CPU)
    assert e.value.problems == [
        f"recipe key 'model.num_layers': the checkpoint {step} was trained with another network (model.num_layers: "
        "4 there, 2 here; model.num_attention_heads: 4 there, 8 here; model.ffn_hidden_size: 512 there, 256 here), "
        "and a run resumes only with its own; set model.num_layers=4 model.num_attention_heads=4 "
        "model.ffn_hidden_size=512 to continue it, or use a new run_dir"]
    with pytest.raises(PlanError, match=r"recipe key 'feedback.fusion': .* another network \(feedback.fusion: glu "
                                        r"there, 'off' here\)"):
        resolve_run(load_recipe(data={**run, "feedback": {"fusion": "off"}}), 1, CPU)
    # a standard model has no fusion, so no fusion bias to keep
    plain = load_recipe(data={"model": run["model"], "feedback": {"fusion": "off", "bias": False}})
    (step / "state.json").write_text(json.dumps({"recipe": plain.model_dump(mode="json"), "train_state": {"step": 4}}))
    assert resolve_run(load_recipe(data={**run, "feedback": {"fusion": "off", "bias": True}}), 1, CPU).resume.step == 4


@pytest.mark.parametrize("resumed, steps, stop, names", [
    (7, 8, None, None), (7, 8, 8, None), (5, 8, 6, None),  # it trains
    (8, 8, None, "of 8: nothing to train (raise train.steps to continue, or use a new run_dir)"),
    (9, 8, 12, "of 8: nothing to train (raise train.steps to continue, or use a new run_dir)"),
    (6, 8, 6, ", at or past train.stop_at_step=6: nothing to train (raise or remove train.stop_at_step)"),
    (8, 8, 6, "of 8, at or past train.stop_at_step=6: nothing to train (raise train.steps, and raise or remove "
              "train.stop_at_step, to continue; or use a new run_dir)"),
], ids=["trains", "trains_to_the_stop", "trains_to_an_early_stop", "steps", "steps_stop_beyond", "stop", "both"])
def test_nothing_to_train_names_the_limit_to_raise(resumed, steps, stop, names):
    from types import SimpleNamespace

    from fbt_megatron.resolve.plan import nothing_to_train

    said = nothing_to_train(Path("runs/x"), resumed, SimpleNamespace(steps=steps, stop_at_step=stop))
    assert (said is None) if names is None else (said.startswith(f"runs/x is already at step {resumed}") and
                                                 names in said), said


def _resumed_run_on_a_dataset(tmp_path, fingerprints: dict) -> tuple[dict, Path]:
    """A prepared dataset ``tmp_path/web`` and a run whose latest checkpoint recorded ``fingerprints`` for it:
    (the recipe's data, the checkpoint's folder)."""
    from data_pipeline.prepare import prepare_dataset
    from tests.support.data_fixtures import write_corpus
    from tests.support.generate_helpers import make_tokenizer

    tok = make_tokenizer(tmp_path / "tok")
    write_corpus(tmp_path / "raw", 0, sizes=(20, 1, 1))
    prepare_dataset([str(tmp_path / "raw" / "web.jsonl")], tmp_path / "web", tok, name="web", num_workers=1,
                    progress=False)
    step = tmp_path / "run" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step.parent / "latest").write_text("step_00000004\n")
    (step / "state.json").write_text(json.dumps({"recipe": {}, "data": {"fingerprints": fingerprints}}))
    data = {"run_dir": str(tmp_path / "run"), "data": {"source": "pipeline", "pipeline": {
        "tokenizer": str(tok), "sources": [{"name": "web", "path": str(tmp_path / "web"), "weight": 1.0}]}}}
    return data, step


def test_a_resume_on_changed_data_is_refused_before_launch(tmp_path, monkeypatch):
    """The resumed checkpoint recorded other fingerprints of its dataset: the plan (so --dry-run and
    slurm submit) refuses it by the source's name; checkpoint.allow_data_change lets it through."""
    from fbt_megatron.data import fingerprint

    old = {"web": {"path": str(tmp_path / "web"), "tokenizer_hash": "t", "documents": 119, "content": "a"}}
    data, step = _resumed_run_on_a_dataset(tmp_path, old)
    now = {"web": dict(old["web"], content="b")}
    monkeypatch.setattr(fingerprint, "data_fingerprints", lambda config: now)
    with pytest.raises(PlanError) as e:
        resolve_run(load_recipe(data=data), 1, CPU)
    assert e.value.problems[0].startswith("recipe key 'data.pipeline': the data changed since checkpoint")
    assert "source 'web'" in str(e.value) and "the same 119 documents count but other content" in str(e.value)
    data["checkpoint"] = {"allow_data_change": True}
    assert resolve_run(load_recipe(data=data), 1, CPU).resume.checkpoint == step


def test_a_resume_from_synthetic_steps_onto_prepared_data_is_a_data_change(tmp_path):
    """Steps trained on synthetic data (as fbt convert from-hf's recipe runs as written), resumed on prepared
    data: refused as a data change, with the flag that continues (its loader position names no document);
    an import's step 0, which consumed nothing, goes on to prepared data as is."""
    data, step = _resumed_run_on_a_dataset(tmp_path, {})
    state = {"recipe": {"data": {"source": "synthetic"}}, "train_state": {"step": 20}, "data": {"fingerprints": None}}
    (step / "state.json").write_text(json.dumps(state))
    with pytest.raises(PlanError) as e:
        resolve_run(load_recipe(data=data), 1, CPU)
    assert e.value.problems[0] == (
        f"recipe key 'data.source': checkpoint {step} trained on synthetic data (data.source: synthetic) and the "
        "recipe reads prepared data: set data.source=synthetic to go on as before, start a new run_dir, or set "
        "checkpoint.allow_data_change=true to continue on the prepared data")
    assert resolve_run(load_recipe(data={**data, "checkpoint": {"allow_data_change": True}}), 1, CPU).resume.checkpoint \
        == step
    (step / "state.json").write_text(json.dumps({**state, "train_state": {"step": 0}}))
    assert resolve_run(load_recipe(data=data), 1, CPU).resume.checkpoint == step


def test_the_trainer_refuses_synthetic_steps_onto_prepared_data_by_itself(tmp_path, monkeypatch):
    """The trainer checks the resumed checkpoint's data again (its plan may predate the change): steps on
    synthetic data then prepared data are refused there too; allow_data_change continues, logs the change
    and records it in metrics.jsonl and the next checkpoint's data record."""
    from fbt_megatron.data.fingerprint import DataChangedError
    from fbt_megatron.data.loaders import data_pipeline_config
    from fbt_megatron.train import run

    data, step = _resumed_run_on_a_dataset(tmp_path, {})
    state = {"recipe": {"data": {"source": "synthetic"}}, "train_state": {"step": 20}, "data": {"fingerprints": None}}
    (step / "state.json").write_text(json.dumps(state))
    recipe = load_recipe(data=data)
    config, said = data_pipeline_config(recipe), []
    with pytest.raises(DataChangedError, match=rf"^checkpoint {step} trained on synthetic data \(data.source: "
                                               r"synthetic\) and the recipe reads prepared data: set data.source"):
        run._data_record(recipe, config, step, tmp_path / "run", said.append)
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and said == []
    monkeypatch.setattr(run.dist, "get_rank", lambda: 0)
    allowed = load_recipe(data={**data, "checkpoint": {"allow_data_change": True}})
    record, changed = run._data_record(allowed, config, step, tmp_path / "run", said.append)
    assert changed and record["fingerprints"]["web"]["documents"] > 0
    assert record["changes"] == [{"step": 20, "changes": [
        "the checkpoint trained on synthetic data (data.source: synthetic), the recipe reads prepared data"]}]
    (row,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["event"] == "data_changed" and row["step"] == 20 and said[0].startswith(f"data changed since {step}")
    (step / "state.json").write_text(json.dumps({**state, "train_state": {"step": 0}}))  # an import's step 0
    assert run._data_record(recipe, config, step, tmp_path / "run", said.append)[1] is False


def test_a_held_out_count_a_source_cannot_spare_is_a_plan_problem(tmp_path):
    """``data.pipeline.valid_documents`` that would hold out every document of a source: the plan (so
    --dry-run and slurm submit) names the recipe key and the source, as the loader would at start-up."""
    data, _ = _resumed_run_on_a_dataset(tmp_path, {})
    documents = json.loads((tmp_path / "web" / "index.json").read_text())["num_samples"]
    data["data"]["pipeline"]["valid_documents"] = documents
    with pytest.raises(PlanError) as e:
        resolve_run(load_recipe(data=data), 1, CPU)
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(
        f"recipe key 'data.pipeline.valid_documents': valid_documents={documents} would hold out every document "
        f"of source 'web' ({documents} documents"), e.value
    data["data"]["pipeline"]["valid_documents"] = documents - 1
    data["checkpoint"] = {"allow_data_change": True}  # the stand-in checkpoint recorded no fingerprints
    assert resolve_run(load_recipe(data=data), 1, CPU).data.config["valid_documents"] == documents - 1
    # a new run (no checkpoint) on a dataset with one of its shards gone, which it may skip
    # (allow_skip_corrupt): the count is still checked
    import shutil

    from data_pipeline.prepare import prepare_dataset
    from data_pipeline.shards import shard_name

    shutil.rmtree(tmp_path / "run")
    pipeline = data["data"]["pipeline"]
    index = prepare_dataset([str(tmp_path / "raw" / "web.jsonl")], tmp_path / "sharded", pipeline["tokenizer"],
                            name="web", num_workers=1, progress=False, shard_bytes=1 << 10)
    assert index["num_shards"] > 1
    (tmp_path / "sharded" / shard_name(0)).unlink()
    pipeline["sources"][0]["path"] = str(tmp_path / "sharded")
    pipeline.update(valid_documents=documents, allow_skip_corrupt=True)
    with pytest.raises(PlanError, match=r"recipe key 'data.pipeline.valid_documents': "):
        resolve_run(load_recipe(data=data), 1, CPU)


def test_a_pipeline_row_length_other_than_the_recipes_is_refused_not_replaced(tmp_path):
    """``data.seq_length`` sets the pipeline's rows; a different ``data.pipeline.seq_length`` (copied from a
    mix.yaml, say) was silently replaced: now it is a plan problem naming both. An equal one is accepted."""
    data, _ = _resumed_run_on_a_dataset(tmp_path, {})
    data["checkpoint"] = {"allow_data_change": True}  # the stand-in checkpoint recorded no fingerprints
    data["data"]["seq_length"] = 32
    data["data"]["pipeline"]["seq_length"] = 7
    with pytest.raises(PlanError) as e:
        resolve_run(load_recipe(data=data), 1, CPU)
    assert e.value.problems == ["recipe key 'data.pipeline.seq_length': 7 differs from data.seq_length (32), which "
                                "sets the rows' length; drop it or set data.seq_length"]
    data["data"]["pipeline"]["seq_length"] = 32
    assert resolve_run(load_recipe(data=data), 1, CPU).data.config["seq_length"] == 32


def test_a_resume_on_an_unreadable_dataset_index_is_a_plan_problem(tmp_path):
    """Reading the fingerprints of a resumed run's dataset can fail (a damaged index): that is one of the
    plan's problems, named by its recipe key, like a changed dataset."""
    data, _ = _resumed_run_on_a_dataset(tmp_path, {})
    for index in (tmp_path / "web").glob("*lengths*"):
        index.write_bytes(b"not an array")
    with pytest.raises(PlanError) as e:
        resolve_run(load_recipe(data=data), 1, CPU)
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith("recipe key 'data.pipeline': "), e.value


def test_dry_run_prints_the_plan_writes_nothing_and_reloads_to_the_same_plan(tmp_path, monkeypatch, capsys):
    from fbt_megatron.cli import main

    shutil.copy(ROOT / "recipes" / "tiny.yaml", tmp_path / "tiny.yaml")
    monkeypatch.chdir(tmp_path)  # the recipe's relative paths (data/embedded, runs/tiny) land here
    monkeypatch.setenv("FBT_DEVICE", "cpu")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    before = _tree(tmp_path)
    assert main(["train", "tiny.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert _tree(tmp_path) == before and not dist.is_initialized()
    printed = yaml.safe_load(out)
    resolved = printed["resolved"]
    assert resolved["layout"]["data"] == 1 and resolved["batch"]["micro_batches_per_step"] == 16 // 8
    assert resolved["data"]["build_embedded"] == "data/embedded" and resolved["precision"] == "fp32"
    again = resolve_run(load_recipe(data=printed["recipe"]), 1)
    assert again.to_dict() == printed
    # the same for 4 processes on H100s, with fbt plan's figures
    assert main(["train", "tiny.yaml", "parallel.tensor=2", "--dry-run", "--world-size", "4", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["resolved"]["layout"]["data"] == 2 and "# fbt plan:\n#   plan: tiny on 4 x h100" in out
    assert "memory/GPU" in out and _tree(tmp_path) == before


def test_dry_run_exits_2_with_every_problem(tmp_path, monkeypatch, capsys):
    from fbt_megatron.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    before = _tree(tmp_path)
    args = ["train", str(ROOT / "recipes" / "tiny.yaml"), "--dry-run", "--world-size", "3", "parallel.tensor=2",
            "model.vocab_size=1000", "task=sft"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("fbt train: error: invalid run plan (3 errors):"), err
    for key in ("parallel.tensor", "data.pipeline", "model.vocab_size"):
        assert f"recipe key '{key}'" in err, key
    assert _tree(tmp_path) == before


def test_fbt_plan_sizes_the_same_plan_without_reading_the_data(capsys):
    """`fbt plan` resolves the plan `fbt train` starts from (its layout problems refused the same way), but
    sizes a cluster recipe whose data is not on this machine."""
    from fbt_megatron.cli import main

    assert main(["plan", str(ROOT / "recipes" / "fbt-1b-400b.yaml"), "--gpus", "64", "--gpu", "h100"]) == 0
    assert "plan: fbt-1b-400b on 64 x h100" in capsys.readouterr().out
    assert main(["plan", str(ROOT / "recipes" / "tiny.yaml"), "parallel.tensor=2", "--gpus", "3"]) == 2
    assert "recipe key 'parallel.tensor': tensor=2 x pipeline=1 does not divide the process count 3" in \
        capsys.readouterr().err


FAKE_SBATCH = """#!/bin/sh
echo "$@" >> "{calls}"
echo 4242
"""


def test_slurm_submit_refuses_before_sbatch_with_the_dry_runs_message(tmp_path, monkeypatch, capsys):
    """TP=4 does not divide 6 heads: `fbt slurm submit` says what `fbt train --dry-run` says for the
    job's 4 processes and never calls sbatch; a good recipe reaches the (recording) sbatch."""
    from fbt_megatron.cli import main

    bin_dir, calls = tmp_path / "bin", tmp_path / "sbatch-calls"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(FAKE_SBATCH.format(calls=calls))
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    recipe = str(ROOT / "recipes" / "tiny.yaml")
    bad = ["data.source=synthetic", "model.hidden_size=192", "model.num_attention_heads=6", "parallel.tensor=4",
           f"run_dir={tmp_path / 'run'}"]
    assert main(["train", recipe, *bad, "--dry-run", "--world-size", "4"]) == 2
    dry = capsys.readouterr().err.removeprefix("fbt train: error: ").strip()
    assert "model.num_attention_heads=6 is not divisible by tensor parallel size 4" in dry
    assert main(["slurm", "submit", recipe, "--cpu", "--gpus-per-node", "4", *bad]) == 2
    assert dry in capsys.readouterr().err
    assert not calls.exists() and not (tmp_path / "run").exists()
    # what only the plan reads before launch: the tokenizer the nodes would load first
    section = f"{{tokenizer: {tmp_path / 'tok.model'}, sources: [{{name: a, path: {tmp_path}, weight: 1}}]}}"
    missing = [*bad[1:2], "model.num_attention_heads=4", *bad[3:], "data.source=pipeline", f"data.pipeline={section}"]
    assert main(["train", recipe, *missing, "--dry-run", "--world-size", "4"]) == 2
    dry = capsys.readouterr().err.removeprefix("fbt train: error: ").strip()
    assert "recipe key 'data.pipeline.tokenizer': tokenizer model not found" in dry
    assert main(["slurm", "submit", recipe, "--cpu", "--gpus-per-node", "4", *missing]) == 2
    assert dry in capsys.readouterr().err
    assert not calls.exists() and not (tmp_path / "run").exists()

    good = [*bad[:2], "model.num_attention_heads=4", *bad[3:]]
    assert main(["slurm", "submit", recipe, "--cpu", "--gpus-per-node", "4", *good]) == 0
    assert "submitted tiny: job 4242" in capsys.readouterr().out
    assert len(calls.read_text().splitlines()) == 1
