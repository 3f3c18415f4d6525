"""`fbt slurm submit` refused: a --time sbatch would not take is refused in one sentence before anything is
written; when sbatch refuses the script, the script and the folders this submit made (still empty) are
removed, and whatever was there before is kept."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fbt_megatron.launch.cli import main
from fbt_megatron.launch.submit import SubmitError, check_time, sbatch

FORMATS = ("use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (e.g. 25:00:00 or 1-01:00:00), "
           "or UNLIMITED")


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")} if root.exists() else set()


@pytest.fixture
def fake_sbatch(tmp_path, monkeypatch):
    """sbatch and squeue on PATH: sbatch records each call and refuses as SLURM's does (its error lines on
    stderr) a script whose --time it cannot parse, every script while $FAKE_SBATCH_REFUSE is set (``partition``:
    two lines), or with ``phase2`` only a job that depends on another; squeue lists nothing."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "sbatch-calls"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        f'#!/bin/sh\necho "$@" >> "{calls}"\n'
        'for a; do script="$a"; done\n'
        'if [ "$FAKE_SBATCH_REFUSE" = phase2 ]; then\n'
        '  if grep -q "^#SBATCH --dependency=afterok:" "$script"; then echo "sbatch: error: Invalid dependency" >&2; '
        'exit 1; fi; echo 4242; exit 0\nfi\n'
        'if [ "$FAKE_SBATCH_REFUSE" = partition ]; then\n'
        '  printf "sbatch: error: invalid partition specified: nosuch\\nsbatch: error: Batch job submission failed: '
        'Invalid partition name specified\\n" >&2; exit 1\nfi\n'
        'if grep -q "^#SBATCH --time=25h" "$script" || [ -n "$FAKE_SBATCH_REFUSE" ]; then\n'
        '  echo "sbatch: error: Invalid --time specification" >&2; exit 255\nfi\necho 4242\n')
    (bin_dir / "squeue").write_text("#!/bin/sh\n")
    for tool in ("sbatch", "squeue"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


@pytest.mark.parametrize("value", ["90", "30:00", "25:00:00", "1-12", "1-12:30", "2-02:30:00", "0", "UNLIMITED",
                                   "infinite"])
def test_every_time_format_sbatch_documents_is_taken(value):
    assert check_time(value) == value


@pytest.mark.parametrize("value", ["25h", "1.5", " 5", "1:2:3:4", "1-2-3", ":5", "1::1", "", "1-:5"])
def test_a_time_sbatch_refuses_is_refused_naming_the_formats(value):
    with pytest.raises(SubmitError) as e:
        check_time(value)
    assert str(e.value) == f"--time {value!r} is not a SLURM time limit: {FORMATS}"


@pytest.mark.parametrize("dry_run", [False, True], ids=["submit", "dry-run"])
def test_a_bad_time_is_refused_before_anything_is_written(tmp_path, fake_sbatch, capsys, dry_run):
    run = tmp_path / "runs" / "tiny_slurm2"
    assert main(["submit", "recipes/tiny.yaml", "--nodes", "1", "--gpus-per-node", "2", "--cpu", "--time", "25h",
                 *(["--dry-run"] if dry_run else []), f"run_dir={run}"]) == 2
    out = capsys.readouterr()
    assert out.err == f"fbt slurm submit: --time '25h' is not a SLURM time limit: {FORMATS}\n" and out.out == ""
    assert not (tmp_path / "runs").exists() and not fake_sbatch.exists()  # nothing written, sbatch not called


def test_a_script_sbatch_refuses_leaves_nothing_of_this_submit_behind(tmp_path, fake_sbatch, capsys, monkeypatch):
    """A new run folder: everything the submit made goes again. An existing one: its files and folders stay,
    only the script and the folders made for it go."""
    monkeypatch.setenv("FAKE_SBATCH_REFUSE", "1")
    args = ["submit", "recipes/tiny.yaml", "--gpus-per-node", "2", "--cpu", "--time", "00:30:00"]
    run = tmp_path / "runs" / "new"
    assert main([*args, f"run_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert err == ("fbt slurm submit: sbatch refused the job: sbatch: error: Invalid --time specification; "
                   "nothing was queued, and the script and folders this submit made were removed\n")
    assert len(fake_sbatch.read_text().splitlines()) == 1  # it was submitted, and refused
    assert not (tmp_path / "runs").exists()

    old = tmp_path / "old"  # a run folder with the user's notes and an earlier job's slurm/ folder
    (old / "slurm").mkdir(parents=True)
    (old / "notes.txt").write_text("mine")
    (old / "slurm" / "jobs.jsonl").write_text("")
    before = _files(old)
    assert main([*args, f"run_dir={old}"]) == 2
    assert _files(old) == before and (old / "notes.txt").read_text() == "mine"  # slurm/logs made and removed

    monkeypatch.delenv("FAKE_SBATCH_REFUSE")  # accepted: script and logs folder kept, one script per job
    assert main([*args, f"run_dir={run}"]) == 0 and main([*args, "--dependency", "afterany:4242", f"run_dir={run}"]) == 0
    assert {p.name for p in (run / "slurm").iterdir()} >= {"logs", "jobs.jsonl"}
    scripts = [json.loads(line)["script"] for line in (run / "slurm" / "jobs.jsonl").read_text().splitlines()]
    assert len(set(scripts)) == 2 and sorted(map(str, (run / "slurm").glob("tiny.*.sbatch"))) == sorted(scripts)


def test_a_refused_phase_2_says_that_phase_1_is_queued_and_removes_its_own_script(tmp_path, fake_sbatch, capsys,
                                                                                  monkeypatch):
    monkeypatch.setenv("FAKE_SBATCH_REFUSE", "phase2")
    run = tmp_path / "run"
    assert main(["submit", "recipes/tiny.yaml", "--gpus-per-node", "2", "--cpu", "--phases", f"run_dir={run}"]) == 2
    assert capsys.readouterr().err == (
        "fbt slurm submit: sbatch refused the job: sbatch: error: Invalid dependency; phase 1 is queued as job 4242: "
        "scancel it and submit again, or submit the recipe without --phases with --dependency afterok:4242\n")
    assert [p.name.split(".")[0] for p in (run / "slurm").glob("*.sbatch")] == ["tiny-p1"]  # phase 1's, kept
    assert len((run / "slurm" / "jobs.jsonl").read_text().splitlines()) == 1


def test_sbatch_removes_only_what_it_made(tmp_path, fake_sbatch, monkeypatch):
    """A folder something else wrote into while sbatch ran stays; an existing script is never replaced."""
    monkeypatch.setenv("FAKE_SBATCH_REFUSE", "1")
    logs = tmp_path / "a" / "b" / "logs"
    with pytest.raises(SubmitError, match="^sbatch refused the job"):
        sbatch(tmp_path / "a" / "b" / "job.sbatch", "#!/bin/sh\n", dirs=(logs,))
    assert _files(tmp_path) == {"bin", "bin/sbatch", "bin/squeue", "sbatch-calls"}

    monkeypatch.setenv("FAKE_SBATCH_REFUSE", "partition")  # sbatch's two lines, as one
    with pytest.raises(SubmitError) as e:
        sbatch(tmp_path / "a" / "job.sbatch", "#!/bin/sh\n")
    assert str(e.value) == ("sbatch refused the job: sbatch: error: invalid partition specified: nosuch; sbatch: "
                            "error: Batch job submission failed: Invalid partition name specified")
    assert not (tmp_path / "a").exists()

    kept = tmp_path / "kept.sbatch"
    kept.write_text("earlier")
    with pytest.raises(SubmitError, match="was written meanwhile by another submit: submit again$"):
        sbatch(kept, "#!/bin/sh\n")
    assert kept.read_text() == "earlier"


def test_no_sbatch_is_one_sentence_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(SubmitError, match="^sbatch is not installed here: submit from a SLURM login node$"):
        sbatch(tmp_path / "run" / "slurm" / "job.sbatch", "#!/bin/sh\n", dirs=(tmp_path / "run" / "slurm" / "logs",))
    assert _files(tmp_path) == set()


@pytest.mark.slurm
def test_on_a_real_cluster_a_refused_script_leaves_nothing_behind(slurm_cluster, tmp_path, capsys):
    """The real sbatch refuses an #SBATCH line (--sbatch-arg=--time=25h gets past the up-front check)."""
    run = tmp_path / "run"
    assert main(["submit", "recipes/tiny.yaml", "--gpus-per-node", "2", "--cpu", "--sbatch-arg=--time=25h",
                 f"run_dir={run}"]) == 2
    assert capsys.readouterr().err == (
        "fbt slurm submit: sbatch refused the job: sbatch: error: Invalid --time specification; nothing was queued, "
        "and the script and folders this submit made were removed\n")
    assert not run.exists() and _files(tmp_path) == set()
