"""A transcript in the docs (a code block whose first line is ``$ fbt ...``, the lines after it the output)
shows what the command prints: each is run here and its output compared line by line. A line ``...`` stands
for any lines. docs/results/ is left out: it keeps earlier outputs as history, each with its date."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_TRANSCRIPT = re.compile(r"^```(?:text)?\n\$ (fbt [^\n]*)\n(.*?)^```", re.M | re.S)


def transcripts() -> list[tuple[str, str, list[str]]]:
    pages = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "results" not in p.parts)]
    return [(f"{p.relative_to(ROOT)}:{p.read_text()[:m.start()].count(chr(10)) + 1}", m.group(1),
             m.group(2).splitlines()) for p in pages for m in _TRANSCRIPT.finditer(p.read_text())
            if not m.group(2).startswith("$ ")]  # a list of commands, not a transcript


def shows(shown: list[str], printed: list[str]) -> bool:
    """``printed`` is ``shown`` with each ``...`` line standing for any lines (none included)."""
    if not shown:
        return not printed
    if shown[0] == "...":
        return any(shows(shown[1:], printed[i:]) for i in range(len(printed) + 1))
    return bool(printed) and printed[0] == shown[0] and shows(shown[1:], printed[1:])


def test_an_elision_stands_for_any_lines_and_nothing_else_differs():
    assert shows(["a", "...", "d"], ["a", "b", "c", "d"]) and shows(["a", "...", "b"], ["a", "b"])
    assert not shows(["a", "...", "d"], ["a", "b", "c", "e"]) and not shows(["a"], ["a", "b"])
    assert not shows(["a", "c"], ["a", "b", "c"])


def test_the_docs_hold_transcripts():
    assert len(transcripts()) >= 3  # first-run.md and training.md show a refused recipe, slurm.md a plan


@pytest.mark.parametrize("where,command,shown", transcripts(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_transcript_shows_what_the_command_prints(where, command, shown, tmp_path):
    argv = shlex.split(command)[1:]
    env = dict(os.environ, FBT_DEVICE="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "fbt_megatron.cli", *argv, f"run_dir={tmp_path / 'run'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    printed = (out.stdout + out.stderr).splitlines()
    assert shows(shown, printed), f"{where}: `{command}` prints\n" + "\n".join(printed)
