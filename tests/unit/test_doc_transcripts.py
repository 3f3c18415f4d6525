"""A transcript in the docs (a code block whose first line is ``$ fbt ...``, the lines after it the output)
shows what the command prints: each is run here and its output compared line by line (stdout when it
succeeds, stderr when it fails). A line ``...`` stands for any lines. docs/results/ is left out: it keeps
earlier outputs as history, each with its date.

The commands run in a fresh folder holding the repository's ``recipes/`` and a small tokenizer at
``data/embedded/tokenizer.model``, as a checkout after ``make train`` has one."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_FENCED = re.compile(r"^```[\w-]*\n(.*?)^```", re.M | re.S)
_COMMAND = re.compile(r"^\$ (?:\.venv/bin/)?(fbt .*)$")


def blocks_with_commands() -> list[tuple[str, list[str]]]:
    """Every fenced block of the user docs with a ``$ fbt`` line: (where, its lines)."""
    pages = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "results" not in p.parts)]
    out = []
    for page in pages:
        text = page.read_text()
        for m in _FENCED.finditer(text):
            lines = m.group(1).splitlines()
            if any(_COMMAND.match(line) for line in lines):
                out.append((f"{page.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}", lines))
    return out


def transcripts() -> list[tuple[str, str, list[str]]]:
    """The blocks that are one command and its output; a block of commands alone shows no output."""
    out = []
    for where, lines in blocks_with_commands():
        commands = [line for line in lines if line.startswith("$ ")]
        if len(commands) == len([line for line in lines if line.strip()]):
            continue  # commands only
        assert len(commands) == 1 and _COMMAND.match(lines[0]), \
            f"{where}: a transcript is one `$ fbt ...` line first, then its output"
        out.append((where, _COMMAND.match(lines[0]).group(1), lines[1:]))
    return out


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


def test_every_block_with_a_command_is_a_transcript_or_a_list_of_commands():
    found = transcripts()  # raises on a block that is neither
    assert {where.split(":")[0] for where, _, _ in found} >= {
        "docs/guides/first-run.md", "docs/training.md", "docs/slurm.md", "docs/reliability.md"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    from tests.support.generate_helpers import make_tokenizer

    work = tmp_path_factory.mktemp("transcripts")
    (work / "recipes").symlink_to(ROOT / "recipes")
    (work / "data" / "embedded").mkdir(parents=True)
    make_tokenizer(work / "tok").rename(work / "data" / "embedded" / "tokenizer.model")
    return work


@pytest.mark.parametrize("where,command,shown", transcripts(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_transcript_shows_what_the_command_prints(where, command, shown, workdir):
    env = dict(os.environ, FBT_DEVICE="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "fbt_megatron.cli", *shlex.split(command)[1:]], cwd=workdir, env=env,
                         capture_output=True, text=True, timeout=120)
    # a command that succeeds shows its report (stdout), one that fails its error (stderr); libraries' own
    # warnings on the other stream (torch's "No CUDA runtime" on a CUDA build without a GPU) are not shown
    printed = (out.stdout if out.returncode == 0 else out.stderr).splitlines()
    assert shows(shown, printed), f"{where}: `{command}` prints\n" + "\n".join(printed)
