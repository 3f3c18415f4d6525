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


def die_halfway(monkeypatch):
    """Every text write from now on writes half its text, then the process 'dies'."""
    real_open = open

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
        return HalfFile(f) if "w" in mode else f

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

    save(tmp_path, "study", "# page", {"readouts": {"a_seed1": {"val_loss": {"1": 4.0}}}})
    die_halfway(monkeypatch)
    with pytest.raises(Killed):
        save(tmp_path, "study", "# page 2", {"readouts": {"a_seed1": {}, "b_seed1": {}}})
    monkeypatch.undo()
    assert json.loads((tmp_path / "study.json").read_text()) == {"readouts": {"a_seed1": {"val_loss": {"1": 4.0}}}}
    assert (tmp_path / "study.md").read_text() == "# page\n"
