"""`fbt slurm status` on finished jobs: sacct (the accounting database keeps them) when it is there and
accounting is enabled; scontrol otherwise. The scheduler commands are small scripts on PATH that answer
in the documented output formats (squeue -o '%i|%T|...', sacct --parsable2 --noheader)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fbt_megatron.launch.status import format_status, status


def _tool(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\necho \"$@\" >> \"$(dirname \"$0\")/%s.args\"\n%s\n" % (name, body))
    path.chmod(0o755)


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "slurm").mkdir(parents=True)
    rows = [{"phase": None, "job_name": "tiny", "job_id": "41"}, {"phase": None, "job_name": "tiny", "job_id": "42"}]
    (run / "slurm" / "jobs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_finished_jobs_come_from_sacct(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _tool(bin_dir, "squeue", "echo '42|RUNNING|1:00|30:00|node1'")  # job 41 has left the queue
    _tool(bin_dir, "scontrol", "exit 1")  # ... and scontrol has forgotten it
    _tool(bin_dir, "sacct", "echo '41|COMPLETED|0:0|00:07:12|2026-11-30T21:10:00'")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    text = format_status(status(_run_dir(tmp_path)))
    assert "job 41 tiny: COMPLETED (exit 0:0, elapsed 00:07:12" in text, text
    assert "job 42 tiny: RUNNING" in text
    args = (bin_dir / "sacct.args").read_text()
    assert "--parsable2" in args and "--allocations" in args and "--jobs 41" in args


def test_without_accounting_scontrol_then_gone(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _tool(bin_dir, "squeue", "true")
    _tool(bin_dir, "scontrol", '[ "$4" = 41 ] && echo "JobId=41 JobState=FAILED ExitCode=1:0 Restarts=0"; true')
    _tool(bin_dir, "sacct", "echo 'Slurm accounting storage is disabled' >&2; exit 1")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    s = status(_run_dir(tmp_path))
    states = {j["job_id"]: j["state"] for j in s["jobs"]}
    assert states["41"].startswith("FAILED (exit 1:0") and states["42"].startswith("gone from the scheduler")
