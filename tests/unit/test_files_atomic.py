"""A file written by ``write_text_atomic`` is the old one or the new one, never a part: a kill in the
middle of the write (simulated by a write that stops halfway and raises) leaves the old file whole. The
study's report and read-out cache and a run's summary are written this way, since ``--reuse`` reads them
back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fbt_megatron.files import write_text_atomic


class Killed(BaseException):
    """Stands in for the process dying (SIGKILL, power) during a write."""


def die_halfway(monkeypatch, spare: int = 0):
    """Text writes from now on, after the first ``spare`` ones, write half their text, then the process
    'dies'."""
    real_open = open
    left = [spare]

    class HalfFile:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise Killed

    def half_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if "w" not in mode:
            return f
        left[0] -= 1
        return f if left[0] >= 0 else HalfFile(f)

    def half_write_text(self, data, *args, **kwargs):
        with half_open(self, "w") as f:
            f.write(data)

    monkeypatch.setattr("builtins.open", half_open)
    monkeypatch.setattr(Path, "write_text", half_write_text)


def test_a_write_killed_halfway_leaves_the_old_file_whole_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "report.json"
    write_text_atomic(path, json.dumps({"runs": [1, 2, 3]}))
    assert json.loads(path.read_text()) == {"runs": [1, 2, 3]}
    die_halfway(monkeypatch)
    with pytest.raises(Killed):
        write_text_atomic(path, json.dumps({"runs": [1, 2, 3, 4]}))
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"runs": [1, 2, 3]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    write_text_atomic(path, "new")  # and an ordinary write replaces it
    assert path.read_text() == "new"


def test_the_study_report_survives_a_kill_while_it_is_rewritten(tmp_path, monkeypatch):
    from fbt_megatron.research.report import save

    made = "_Produced by `python tools/feedback_study.py` today._"
    first = {"readouts": {"a_seed1": {"val_loss": {"1": 4.0}}}, "provenance": {}}
    save(tmp_path, "study", f"# page\n\n{made}", first)
    for spare, page in ((0, "# page"), (1, "# page 2")):  # killed writing the page, then writing the JSON
        die_halfway(monkeypatch, spare)
        with pytest.raises(Killed):
            save(tmp_path, "study", f"# page 2\n\n{made}", {"readouts": {"a_seed1": {}, "b_seed1": {}}, "provenance": {}})
        monkeypatch.undo()
        assert json.loads((tmp_path / "study.json").read_text()) == first
        assert (tmp_path / "study.md").read_text() == f"{page}\n\n{made}\n"


def test_a_run_folder_with_a_killed_writes_temporary_is_still_the_runs_own(tmp_path):
    """A research run's folder may hold the temporary file of a write killed outright (``.summary.json.PID.tmp``):
    the folder is still the run's own, replaced when the run is started afresh, not refused as the user's."""
    from data_pipeline.output_dir import earlier_output
    from fbt_megatron.research.runs import RUN_ENTRIES

    run = tmp_path / "run"
    run.mkdir()
    (run / "command.json").write_text("[]")
    (run / "summary.json").write_text("{}")
    (run / ".summary.json.4242.tmp").write_text("{\"step\"")
    assert earlier_output(run, markers=("command.json",), patterns=RUN_ENTRIES, writer="a research run",
                          option="run folder") is True


def test_a_replaced_file_keeps_its_mode(tmp_path):
    path = tmp_path / "mix.yaml"
    path.write_text("old\n")
    path.chmod(0o640)
    write_text_atomic(path, "new\n")
    assert path.read_text() == "new\n" and path.stat().st_mode & 0o777 == 0o640
    fresh = write_text_atomic(tmp_path / "fresh.json", "{}")
    assert fresh.read_text() == "{}" and sorted(p.name for p in tmp_path.iterdir()) == ["fresh.json", "mix.yaml"]



@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
@pytest.mark.parametrize("proc", [True, False], ids=["proc_status", "set_and_restore"])
def test_new_file_mode_is_the_mode_open_gives_a_new_file(tmp_path, monkeypatch, umask, proc):
    """new_file_mode() against the operating system's own answer: the mode of a file open() creates under
    the same umask, read from /proc or (where there is none) by setting the umask; the umask is left as it was."""
    import os
    import stat

    from fbt_megatron import files

    if not proc:
        real = files.Path.read_text
        monkeypatch.setattr(files.Path, "read_text", lambda self, *a, **k: (_ for _ in ()).throw(OSError("no /proc"))
                            if str(self) == "/proc/self/status" else real(self, *a, **k))
    old = os.umask(umask)
    try:
        (tmp_path / "made").write_text("x")
        assert files.new_file_mode() == stat.S_IMODE((tmp_path / "made").stat().st_mode)
        assert os.umask(umask) == umask  # (reads it back, keeps it)
    finally:
        os.umask(old)
