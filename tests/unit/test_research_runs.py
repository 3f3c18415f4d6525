"""A research run that stopped short of its last step (preempted, ``train.stop_at_step``) is never taken as
a result: ``train_run`` says so (:class:`RunStopped`), every tool that reuses run folders trains such a folder
again, resuming it, instead of reading its summary, and a read-out cached from an earlier checkpoint is made
again. A run that diverged (non-finite losses) is :class:`RunDiverged`: one sentence from a tool, and the
feedback study names it in its report and goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from fbt_megatron.research import runs

ROOT = Path(__file__).resolve().parents[2]
STOPPED = {"step": 1138, "total_steps": 2400, "preempted": "SIGTERM", "val_history": [], "pass_counts": {},
           "stop_reason": "preempted: SIGTERM received; stopped after step 1138 with a checkpoint"}
FINISHED = {"step": 2400, "total_steps": 2400, "val_history": [], "pass_counts": {}}
DIVERGED = {"step": 3, "total_steps": 8, "preempted": None, "val_history": [], "pass_counts": {},
            "stop_reason": "stopped: 2 non-finite losses in a row at step 2 (train.max_nonfinite_in_row=2); "
                           "the checkpoint holds the last finite weights"}


def write_summary(run_dir: Path, summary: dict) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def test_a_run_is_finished_only_at_its_last_step(tmp_path):
    assert runs.finished_run(tmp_path / "none") is None
    assert runs.finished_run(write_summary(tmp_path / "stopped", STOPPED)) is None
    assert runs.finished_run(write_summary(tmp_path / "old", {"step": 600})) is None  # no total: not trusted
    assert runs.finished_run(write_summary(tmp_path / "done", FINISHED)) == FINISHED
    assert runs.finished_run(write_summary(tmp_path / "beyond", {**FINISHED, "step": 2401})) is not None


def fake_fbt_train(monkeypatch, summary, exit_status=0):
    """subprocess.run for train_run: the run writes ``summary`` (None: nothing) and exits with
    ``exit_status`` (0, as ``fbt train`` does when preempted)."""
    def fake_run(cmd, cwd, env, stdout, stderr):
        if summary is not None:
            write_summary(Path(cmd[cmd.index("train") + 2].split("=", 1)[1]), summary)
        return subprocess.CompletedProcess(cmd, exit_status)

    monkeypatch.setattr(runs.subprocess, "run", fake_run)


@pytest.mark.parametrize("summary", [STOPPED, {"step": 8, "total_steps": 12}], ids=["preempted", "stop_at_step"])
def test_train_run_raises_for_a_run_that_stopped_short(tmp_path, monkeypatch, summary):
    """train_run tells the caller the run is not finished, naming the step, instead of returning the
    stopped run's summary as if it were complete (whatever stopped it)."""
    fake_fbt_train(monkeypatch, summary)
    with pytest.raises(runs.RunStopped, match=f"stopped at step {summary['step']} of {summary['total_steps']}"):
        runs.train_run("recipes/tiny.yaml", tmp_path / "run", [])


def test_train_run_returns_a_finished_runs_summary(tmp_path, monkeypatch):
    fake_fbt_train(monkeypatch, FINISHED)
    assert runs.train_run("recipes/tiny.yaml", tmp_path / "run", [])["step"] == 2400


def test_a_run_diverged_only_if_it_stopped_on_non_finite_losses(tmp_path):
    assert runs.diverged_run(tmp_path / "none") is None
    assert runs.diverged_run(write_summary(tmp_path / "preempted", STOPPED)) is None
    assert runs.diverged_run(write_summary(tmp_path / "stop_at_step", {"step": 8, "total_steps": 12})) is None
    assert runs.diverged_run(write_summary(tmp_path / "done", FINISHED)) is None
    assert runs.diverged_run(write_summary(tmp_path / "diverged", DIVERGED)) == DIVERGED["stop_reason"]
    at_last_step = write_summary(tmp_path / "last", {**DIVERGED, "step": 8})  # diverged on its last step
    assert runs.diverged_run(at_last_step) == DIVERGED["stop_reason"] and runs.finished_run(at_last_step) is None


@pytest.mark.parametrize("summary, status", [(DIVERGED, 3), ({**DIVERGED, "step": 8}, 3), ({**DIVERGED, "step": 8}, 0)],
                         ids=["mid-run", "at-its-last-step", "resumed-at-its-last-step"])
def test_train_run_raises_run_diverged_only_on_a_recorded_non_finite_stop(tmp_path, monkeypatch, summary, status):
    """A summary that records the non-finite stop is RunDiverged (a user error: the recipe diverged), naming the
    run and the stop: exit status 3, or 0 when a run that diverged on its last step is launched again (it trains
    nothing and keeps that summary). Any other failure stays a RuntimeError (a defect)."""
    fake_fbt_train(monkeypatch, summary, exit_status=status)
    with pytest.raises(runs.RunDiverged, match=r"run in .*run diverged \(stopped: 2 non-finite losses in a row"):
        runs.train_run("recipes/tiny.yaml", tmp_path / "run", [])


def test_train_run_keeps_other_failures_a_runtime_error(tmp_path, monkeypatch):
    """Exit status 3 without a recorded non-finite stop, or another status, is a defect: its traceback is wanted."""
    for summary, status in ((None, 3), (DIVERGED, 1), (FINISHED, 3)):  # no record of the stop; another failure
        fake_fbt_train(monkeypatch, summary, exit_status=status)
        with pytest.raises(RuntimeError) as e:
            runs.train_run("recipes/tiny.yaml", tmp_path / f"other{status}{summary is None}", [])
        assert not isinstance(e.value, runs.RunDiverged)


@pytest.mark.parametrize("stop", [runs.RunStopped, runs.RunDiverged])
def test_several_runs_at_once_say_a_stop_when_it_happens(monkeypatch, stop):
    """With jobs > 1 the pool raises a run's stop (or divergence) only once the runs before it are done; it is
    printed at once, while another run still trains."""
    import io
    import threading
    import time

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    said = threading.Event()

    def job(i):
        if i == 1:
            raise stop("run 1 stopped at step 3 of 9")
        deadline = time.monotonic() + 5  # run 0 trains on until it sees the stop said (or gives up)
        while time.monotonic() < deadline and not said.is_set():
            if "run 1 stopped" in err.getvalue():
                said.set()
            time.sleep(0.01)
        return i

    monkeypatch.setenv("FBT_CPU_THREADS", "1")
    with pytest.raises(stop):
        runs.run_jobs(job, [(0,), (1,)], jobs=2)
    assert said.is_set()


def data_efficiency(tmp_path, monkeypatch):
    import data_efficiency

    data_efficiency.run([1], 600, tmp_path, reuse=True)


def switch_init(tmp_path, monkeypatch):
    import switch_init

    from fbt_megatron.research import report

    monkeypatch.setattr(switch_init, "render", lambda data, out: SimpleNamespace(read_text=lambda: ""))
    monkeypatch.setattr(report, "provenance_record", lambda *a, **k: {})
    switch_init.main(["--variants", "0,1,2", "--runs", str(tmp_path), "--reuse", "--out", str(tmp_path / "out")])


def sft_math(tmp_path, monkeypatch):
    import sft_math

    a = SimpleNamespace(pretrain_steps=100, sft_steps=20, force=False)
    sft_math.runs_for_seed(1, a, tmp_path, tmp_path / "chat")


def feedback_study(tmp_path, monkeypatch):
    import feedback_study

    import data_pipeline.embedded

    monkeypatch.setattr(data_pipeline.embedded, "build_embedded", lambda *a, **k: None)
    monkeypatch.setattr(feedback_study, "run_overrides", lambda *a: [])
    feedback_study.train({"fbt": [], "state": [], "standard": []}, [1], tmp_path, 1, True)


# each tool's run folders under tmp_path: (stopped, finished, absent)
FOLDERS = {
    data_efficiency: ("fbt_seed1", "state_seed1", "standard_seed1"),
    switch_init: ("variant0", "variant1", "variant2"),
    sft_math: ("seed1/fbt_base", "seed1/std_base", "seed1/fbt_sft"),
    feedback_study: ("fbt_seed1", "state_seed1", "standard_seed1"),
}


@pytest.mark.parametrize("tool", FOLDERS, ids=lambda f: f.__name__)
def test_reusing_tools_resume_a_stopped_run_and_keep_a_finished_one(tmp_path, monkeypatch, tool):
    """A folder whose run stopped short is trained again with ``resume`` (from its checkpoint); a finished
    one is read, not trained; an absent one is trained."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    stopped, finished, absent = FOLDERS[tool]
    write_summary(tmp_path / stopped, STOPPED)
    write_summary(tmp_path / finished, FINISHED)
    trained = {}

    def fake_train_run(recipe, run_dir, overrides, log_file=None, resume=False):
        trained[str(Path(run_dir).relative_to(tmp_path))] = resume
        return {**FINISHED, "val_loss_1pass": 3.0}

    monkeypatch.setattr(runs, "train_run", fake_train_run)
    tool(tmp_path, monkeypatch)
    assert trained[stopped] is True and trained[absent] is True
    assert finished not in trained


@pytest.mark.parametrize("stop", [runs.RunStopped("the run in X stopped at step 3 of 9 (preempted)"),
                                  runs.RunDiverged("the run in X diverged (stopped: 2 non-finite losses in a row)")],
                         ids=["stopped", "diverged"])
def test_a_stopped_run_ends_a_tool_with_one_sentence(tmp_path, monkeypatch, capsys, stop):
    """Under a results tool's entry point a stopped or diverged run is one sentence on stderr (it says what to
    do), not a traceback, and nothing is rendered from it."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import switch_init

    from fbt_megatron.research.report import run_tool

    def stopped(*a, **k):
        raise stop

    monkeypatch.setattr(runs, "train_run", stopped)
    monkeypatch.setattr(switch_init, "render", lambda *a: pytest.fail("a stopped run was rendered"))
    assert run_tool(switch_init.main, "switch_init", ["--variants", "0", "--runs", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(stop) in err and "Traceback" not in err


def test_the_study_goes_on_past_a_stopped_run(tmp_path, monkeypatch):
    """feedback_study trains the other runs and reads out none that stopped (it is not recorded)."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import feedback_study

    import data_pipeline.embedded

    monkeypatch.setattr(data_pipeline.embedded, "build_embedded", lambda *a, **k: None)

    def train_run(recipe, run_dir, overrides, log_file=None, resume=False):
        if Path(run_dir).name == "standard_seed3":
            raise runs.RunStopped("stopped")
        return dict(FINISHED)

    monkeypatch.setattr(runs, "train_run", train_run)
    assert feedback_study.train({"standard": [], "fbt": []}, [3], tmp_path, 1, True) == {"fbt_seed3": FINISHED}


def test_the_study_names_a_diverged_run_and_goes_on(tmp_path, monkeypatch, capsys):
    """feedback_study trains the runs after one that diverges, does not train a diverged folder again under
    --reuse (it would diverge again), and its report names the diverged run with its stop; a narrower report
    keeps that record."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    monkeypatch.chdir(ROOT)  # main changes to the repository; restored after the test
    import feedback_study

    import data_pipeline.embedded
    from fbt_megatron.research import report, study

    monkeypatch.setattr(data_pipeline.embedded, "build_embedded", lambda *a, **k: None)
    trained = []

    def train_run(recipe, run_dir, overrides, log_file=None, resume=False):
        trained.append(Path(run_dir).name)
        if Path(run_dir).name.startswith("fbt"):
            write_summary(Path(run_dir), DIVERGED)
            raise runs.RunDiverged(f"the run in {run_dir} diverged")
        return write_summary(Path(run_dir), FINISHED) and dict(FINISHED)

    monkeypatch.setattr(runs, "train_run", train_run)
    answers = {"standard": {"answer_nll": 2.0, "exact_match": 0.0}}
    monkeypatch.setattr(study, "read_out", lambda run_dir, **k: {"val_loss": {"1": 5.0}, "seq_length": 8,
                                                                  "answers": answers, "fusion_history": []})
    monkeypatch.setattr(report, "figure", lambda **k: (None, [study._NoAxes(), study._NoAxes()]))
    argv = ["--groups", "budget", "--only", "fbt_heavy_untied_fusion_lr_x10_loss_mean,standard_untied",
            "--fbt-recipe", "loss_mean", "--seeds", "1", "--jobs", "1", "--runs", str(tmp_path / "runs"),
            "--out", str(tmp_path / "out")]
    assert feedback_study.main(argv) == 0
    assert trained == ["fbt_heavy_untied_fusion_lr_x10_loss_mean_seed1", "standard_untied_seed1"]
    fbt_dir = tmp_path / "runs" / "fbt_heavy_untied_fusion_lr_x10_loss_mean_seed1"
    assert f"[feedback_study] the run in {fbt_dir} diverged" in capsys.readouterr().out  # said, not raised
    [report_json] = (tmp_path / "out").glob("*.json")
    data = json.loads(report_json.read_text())
    assert data["diverged"] == {"fbt_heavy_untied_fusion_lr_x10_loss_mean_seed1": DIVERGED["stop_reason"]}
    assert list(data["readouts"]) == ["standard_untied_seed1"]
    md = report_json.with_suffix(".md").read_text()
    assert "Diverged, not read out: fbt_heavy_untied_fusion_lr_x10_loss_mean_seed1 (stopped: 2 non-finite" in md
    trained.clear()
    assert feedback_study.main([*argv, "--reuse"]) == 0  # nothing trained again: one finished, one diverged
    assert trained == [] and "diverged before" in capsys.readouterr().out
    assert json.loads(report_json.read_text())["diverged"] == data["diverged"]
    narrower = [*argv, "--reuse"]
    narrower[narrower.index("--only") + 1] = "standard_untied"
    assert feedback_study.main(narrower) == 0
    assert json.loads(report_json.read_text())["diverged"] == data["diverged"]


def test_a_run_recorded_before_and_diverged_now_is_not_kept_as_recorded(tmp_path, monkeypatch):
    """A run recorded in the report, trained again and diverged, is named as diverged only: its earlier record
    is neither kept in the JSON nor listed as "not selected"."""
    from fbt_megatron.research import report, study

    monkeypatch.setattr(report, "figure", lambda **k: (None, [study._NoAxes(), study._NoAxes()]))
    answers = {"standard": {"answer_nll": 2.0, "exact_match": 0.0}}
    recorded = {"fbt_seed1": {"val_history": [{"step": 10, "tokens": 10, "loss": {"1": 5.0}}],
                              "readouts": {"val_loss": {"1": 5.0}, "seq_length": 8, "answers": answers,
                                           "fusion_history": []}}}
    args = SimpleNamespace(seeds="1", groups="main", scale="tiny", steps=None, lr=None, only=None)
    study.render({}, {}, [1], args, 1.0, tmp_path, "t", kept=recorded, diverged={"fbt_seed1": "stopped: nan"})
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["readouts"] == {} and data["kept"] == [] and data["diverged"] == {"fbt_seed1": "stopped: nan"}
    md = (tmp_path / "t.md").read_text()
    assert "not selected here" not in md and "Diverged, not read out: fbt_seed1 (stopped: nan)." in md


@pytest.mark.slow  # one fbt train subprocess (~20 s)
def test_a_real_diverging_run_is_run_diverged(tmp_path):
    """fbt train at an absurd learning rate stops on non-finite losses with exit status 3; train_run says so
    as RunDiverged, and the folder reads as diverged, not finished."""
    run_dir = tmp_path / "run"
    with pytest.raises(runs.RunDiverged, match="non-finite losses in a row"):
        runs.train_run("recipes/tiny.yaml", run_dir, [
            "train.steps=8", "optimizer.lr=1e30", "lr_schedule.warmup_steps=0", "train.max_nonfinite_in_row=2",
            "eval.every=100", "checkpoint.every=4"])
    assert runs.diverged_run(run_dir) and runs.finished_run(run_dir) is None


def test_fixed_point_continues_stopped_runs_and_analyses_only_finished_ones(tmp_path, monkeypatch, capsys):
    """fixed_point continues a mix's stopped run and trains the rest afresh, a finished one too (as it always
    did: the page's time includes training); ``--skip-training`` refuses a folder whose run stopped short or diverged, in one sentence each, before analysing."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import fixed_point

    from fbt_megatron.research.report import run_tool

    resumed = {}
    monkeypatch.setattr(runs, "train_run", lambda recipe, run_dir, overrides, resume=False:
                        resumed.update({Path(run_dir).name: resume}))
    first, *rest = fixed_point.MIXES
    write_summary(tmp_path / first, FINISHED)
    fixed_point.train_models(tmp_path, 600, 120)
    assert resumed == {first: False, **{name: True for name in rest}}  # a finished run trains afresh

    monkeypatch.setattr(fixed_point, "analyse", lambda *a: pytest.fail("a stopped run was analysed"))
    write_summary(tmp_path / first, STOPPED)
    for name in rest:
        write_summary(tmp_path / name, FINISHED)
    assert run_tool(fixed_point.main, "fixed_point", ["--skip-training", "--runs", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / first} holds no finished run" in err and "Traceback" not in err

    write_summary(tmp_path / first, DIVERGED)  # a diverged run is named as such, not as stopped short
    assert run_tool(fixed_point.main, "fixed_point", ["--skip-training", "--runs", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"the run in {tmp_path / first} diverged (" in err and "stopped short" not in err


@pytest.mark.parametrize("cached_at, latest, read_again", [
    ("checkpoints/step_00001138", "step_00002400", True),  # read out when stopped, trained on since
    ("checkpoints/step_00002400", "step_00002400", False),
    ("/elsewhere/run/checkpoints/step_00002400", "step_00002400", False),  # an older cache, a moved folder
    ("checkpoints/step_00002400.old", "step_00002400", False),  # read out while a re-save was cut short
    ("/elsewhere/run/checkpoints/step_00001138", "step_00002400", True),
    ("checkpoints/step_00001138", None, False),  # no checkpoint kept: the cache is all there is
])
def test_a_read_out_cache_is_used_only_for_the_runs_latest_checkpoint(tmp_path, monkeypatch, cached_at, latest,
                                                                     read_again):
    import fbt_megatron.checkpoint.model as checkpoint_model
    from fbt_megatron.research.study import read_out

    class ReadAgain(Exception):
        pass

    def load(*a, **k):
        raise ReadAgain

    monkeypatch.setattr(checkpoint_model, "load_checkpoint_model", load)
    cached = {"checkpoint": cached_at, "validation": "held_out", "fusion": "off", "val_loss": {"1": 3.4}}
    (tmp_path / "readouts.json").write_text(json.dumps(cached))
    if latest:
        (tmp_path / "checkpoints" / latest).mkdir(parents=True)
        (tmp_path / "checkpoints" / latest / "state.json").write_text("{}")
        (tmp_path / "checkpoints" / "latest").write_text(latest)
    if read_again:
        with pytest.raises(ReadAgain):
            read_out(tmp_path)
    else:
        assert read_out(tmp_path) == cached


def test_the_study_reads_a_recorded_run_from_its_report_while_its_folder_holds_a_stopped_run(tmp_path, monkeypatch):
    """A run recorded in the report whose folder now holds a stopped run (trained again, stopped) keeps its
    recorded read-outs: the stopped checkpoint is not the recorded model and is not read out."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    monkeypatch.chdir(ROOT)  # main changes to the repository; restored after the test
    import feedback_study

    from fbt_megatron.research import study

    recorded = {"standard_seed1": {"val_history": [], "readouts": {"val_loss": {"1": 3.4}}}}
    write_summary(tmp_path / "standard_seed1", STOPPED)
    monkeypatch.setattr(feedback_study, "recorded_runs", lambda report: recorded)
    monkeypatch.setattr(feedback_study, "train", lambda runs, seeds, root, jobs, reuse, rec, **k:
                        {name: r for name, r in rec.items()})
    monkeypatch.setattr(feedback_study, "add_layer_counts", lambda readouts, runs: None)
    monkeypatch.setattr(study, "read_out", lambda *a, **k: pytest.fail("the stopped run was read out"))
    seen = {}

    def render(summaries, readouts, *a, **k):
        seen.update(readouts)
        return SimpleNamespace(read_text=lambda: "")

    monkeypatch.setattr(study, "render", render)
    feedback_study.main(["--groups", "budget", "--seeds", "1", "--summarise-only", "--runs", str(tmp_path),
                         "--out", str(tmp_path / "out")])
    assert seen == {"standard_seed1": {"val_loss": {"1": 3.4}}}


@pytest.mark.slow  # a subprocess; on a fresh checkout it builds the embedded data first
def test_the_study_command_says_a_user_error_in_one_sentence(tmp_path):
    """``python tools/feedback_study.py`` prints a cause the user can fix (here a run folder holding a file
    the study did not write) as one sentence with exit status 2, no traceback, and keeps the file."""
    mine = tmp_path / "runs" / "standard_seed1" / "notes.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text("mine")
    p = subprocess.run([sys.executable, str(ROOT / "tools/feedback_study.py"), "--smoke", "--groups", "main",
                        "--only", "standard", "--seeds", "1", "--jobs", "1", "--runs", str(tmp_path / "runs"),
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "FBT_CPU_THREADS": "1"})
    assert p.returncode == 2, p.stderr
    assert "feedback_study: error: run folder" in p.stderr and "Traceback" not in p.stderr
    assert mine.read_text() == "mine"
