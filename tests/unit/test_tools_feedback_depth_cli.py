"""tools/feedback_depth.py as a user runs it: a mistyped run directory, pass list or --json target is one
sentence with exit status 2 (before: a traceback per rank), and --json replaces only its own report."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "feedback_depth.py"


def _run(*args, cwd):
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={**os.environ, "FBT_CPU_THREADS": "1"})


def test_a_mistyped_run_directory_is_one_sentence(tmp_path):
    p = _run(str(tmp_path / "runs" / "tyni"), cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1] == (f"feedback_depth: error: {tmp_path / 'runs' / 'tyni'} does not exist: "
                                                 "give a run directory or a checkpoint's step_N directory")


@pytest.mark.parametrize("passes, said", [("1,two", "'1,two': each pass count 'two' is not an integer"),
                                          ("1,0", "'1,0': each pass count must be an integer >= 1 (got 0)")])
def test_a_bad_pass_list_is_named(passes, said, tmp_path):
    p = _run("run", "--passes", passes, cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.strip().endswith(f"argument --passes: {said}"), p.stderr


def test_json_replaces_only_its_own_report(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from feedback_depth import check_json_out
    finally:
        sys.path.remove(str(ROOT / "tools"))
    from fbt_megatron.errors import UserError

    mine = tmp_path / "notes.json"
    mine.write_text('{"mine": 1}')
    p = _run("run", "--json", str(mine), cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.strip().endswith(
        f"--json {mine} exists and is not a report of this tool: nothing was changed; choose another file, or move "
        "it away"), p.stderr
    assert mine.read_text() == '{"mine": 1}'
    with pytest.raises(UserError, match="is a directory: give a file name"):
        check_json_out(tmp_path)
    with pytest.raises(UserError, match=r"the folder .*nowhere does not exist$"):  # before: a traceback after the run
        check_json_out(tmp_path / "nowhere" / "depth.json")
    ours = tmp_path / "depth.json"
    ours.write_text(json.dumps({"checkpoint": "c", "seq_length": 8, "rows": []}))
    check_json_out(ours)  # an earlier report of the tool: replaced
    check_json_out(tmp_path / "new.json")
