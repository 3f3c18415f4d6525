"""CLI conventions: --help on every command and sub-command, --version, an unknown command is an
error line; logging levels (-q, -v, --log-level) and rank-aware reporting."""

from __future__ import annotations

import logging
from importlib.metadata import version

import pytest

from fbt_megatron.cli import COMMANDS, main

HELP = [[c, "--help"] for c in COMMANDS] + [
    ["train", "recipes/tiny.yaml", "--help"], ["train", "recipes/tiny.yaml", "model.hidden_size=64", "-h"],
    ["slurm", "status", "--help"], ["slurm", "submit", "--help"], ["convert", "to-hf", "--help"],
    ["convert", "from-hf", "--help"], ["ckpt", "verify", "--help"], ["data", "prepare", "--help"],
]


@pytest.mark.parametrize("argv", HELP, ids=lambda a: " ".join(a))
def test_help_works_everywhere(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"fbt {argv[0]}" in out, out[:500]


def test_version_and_unknown_command(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"fbt_megatron {version('fbt_megatron')}"
    assert main(["trian", "recipes/tiny.yaml"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err and "train" in err
    assert main(["slurm", "stauts", "runs/x"]) == 2
    assert "unknown command 'stauts'" in capsys.readouterr().err
    assert main([]) == 2 and "usage: fbt" in capsys.readouterr().err


def _report(capsys, *flags, rank=None, monkeypatch=None):
    from fbt_megatron import logs

    if rank is not None:
        monkeypatch.setenv("RANK", str(rank))
    assert main([*flags, "slurm", "status", "--help"]) == 0  # sets the logging up, then runs a command
    capsys.readouterr()
    log = logging.getLogger("fbt_megatron.train.trainer")
    log.debug("a debug line")
    log.info("an info line")
    log.warning("a warning line")
    logs.setup("INFO")  # leave the default behind for later tests
    return capsys.readouterr().err


def test_log_levels_and_ranks(capsys, monkeypatch):
    monkeypatch.delenv("FBT_LOG_LEVEL", raising=False)
    err = _report(capsys)
    assert "an info line" in err and "a warning line" in err and "debug" not in err
    err = _report(capsys, "-q")
    assert "info" not in err and "a warning line" in err
    err = _report(capsys, "-v")
    assert "DEBUG fbt_megatron.train.trainer: a debug line" in err and "an info line" in err
    err = _report(capsys, "--log-level", "warning")
    assert "info" not in err and "a warning line" in err
    monkeypatch.setenv("FBT_LOG_LEVEL", "ERROR")
    err = _report(capsys)
    assert err == ""
    monkeypatch.delenv("FBT_LOG_LEVEL")
    # rank-aware: other ranks report warnings only, unless --log-all-ranks (then prefixed)
    err = _report(capsys, rank=1, monkeypatch=monkeypatch)
    assert "info" not in err and "a warning line" in err
    err = _report(capsys, "--log-all-ranks", rank=1, monkeypatch=monkeypatch)
    assert "[rank 1] an info line" in err


def test_the_demo_trains_one_to_three_passes_and_checks_the_recurrence(capsys, monkeypatch):
    """`fbt demo`, the installation's smoke test: one pass gives W_U no gradient (it feeds no state: the
    plain model), two and three do; the teacher-forced passes equal the token-by-token recurrence."""
    import re

    monkeypatch.setenv("FBT_DEVICE", "cpu")
    assert main(["demo", "--seq", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    grads = [float(re.search(r"\|grad W_U\|=(\S+)", line).group(1)) for line in lines[:3]]
    assert [line.split()[0] for line in lines[:3]] == ["passes=1", "passes=2", "passes=3"]
    assert grads[0] == 0.0 and grads[1] > 0 and grads[2] > 0, lines
    assert lines[3].startswith("8-pass teacher forcing vs sequential recurrence: relative error"), lines


@pytest.mark.slow  # fbt train end to end (~10 s)
def test_training_progress_is_logged_and_summary_is_on_stdout(tmp_path, capsys, monkeypatch):
    """`fbt train`: the progress lines go through logging (stderr; -q silences them), the summary (the
    result) to stdout."""
    monkeypatch.delenv("FBT_LOG_LEVEL", raising=False)
    monkeypatch.setenv("FBT_DEVICE", "cpu")
    args = ["train", "recipes/tiny.yaml", "data.source=synthetic", "train.steps=2", "checkpoint.every=1000",
            "eval.at_end=false", "logging.tensorboard=false", "logging.log_every=1", f"run_dir={tmp_path / 'a'}"]
    assert main(args) == 0
    cap = capsys.readouterr()
    assert "step      2/2 | loss" in cap.err and "checkpoint saved" in cap.err
    assert "== summary: tiny ==" in cap.out and "step      2/2" not in cap.out
    assert main(["-q", *args[:-1], f"run_dir={tmp_path / 'b'}"]) == 0
    cap = capsys.readouterr()
    assert "loss" not in cap.err and "== summary: tiny ==" in cap.out


def test_ckpt_verify_shows_progress_over_the_bytes(tmp_path, capsys):
    """`fbt ckpt verify` reads every byte: a progress bar (stderr) counts them; results stay on stdout."""
    from fbt_megatron.checkpoint.cli import verify
    from fbt_megatron.checkpoint.manager import file_crc32

    (tmp_path / "weights").mkdir()
    good, bad = tmp_path / "weights" / "a.distcp", tmp_path / "weights" / "b.distcp"
    good.write_bytes(b"x" * 3000)
    bad.write_bytes(b"y" * 2000)
    files = {"weights/a.distcp": {"bytes": 3000, "crc32": file_crc32(good)},
             "weights/b.distcp": {"bytes": 2000, "crc32": "00000000"}}
    import json

    (tmp_path / "manifest.json").write_text(json.dumps({"files": files}))
    problems = verify(tmp_path, check_model=False, progress=True)
    assert len(problems) == 1 and "b.distcp" in problems[0]
    err = capsys.readouterr().err
    assert f"verify {tmp_path.name}" in err and "5.00k/5.00k" in err, err  # every byte counted


@pytest.mark.parametrize("argv, rc", [(["convert", "to-hf", "{missing}", "{tmp}/hf"], 2),
                                      (["generate", "{missing}", "--prompt", "a"], 2),
                                      (["ckpt", "verify", "{missing}"], 1)])  # fbt ckpt: 1, not verified
def test_a_checkpoint_path_that_does_not_exist_is_named_so(argv, rc, tmp_path, capsys):
    """A mistyped run directory is said to be missing, in one sentence, not described as a folder without a
    checkpoint."""
    from fbt_megatron.cli import main

    missing = tmp_path / "runs" / "tny"
    assert main([a.format(missing=missing, tmp=tmp_path) for a in argv]) == rc
    err = capsys.readouterr().err
    assert f"{missing} does not exist: give a run directory or a checkpoint's step_N directory" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_convert_from_hf_keeps_a_users_recipe_in_its_checkpoint_dir(tmp_path, capsys):
    """fbt convert from-hf writes CHECKPOINT_DIR/recipe.yaml: a user's own recipe.yaml there is refused in one
    sentence before the Hugging Face folder is read, and kept."""
    from fbt_megatron.cli import main

    out = tmp_path / "runs" / "llama_ft"
    out.mkdir(parents=True)
    (out / "recipe.yaml").write_text("# my recipe\nmodel: {hidden_size: 64}\n")
    assert main(["convert", "from-hf", str(tmp_path / "no_such_hf_dir"), str(out)]) == 2
    assert capsys.readouterr().err == (
        f"fbt convert: error: CHECKPOINT_DIR {out} holds recipe.yaml, which fbt convert from-hf did not write: "
        "nothing was changed; choose an empty CHECKPOINT_DIR, or move it away\n")
    assert (out / "recipe.yaml").read_text() == "# my recipe\nmodel: {hidden_size: 64}\n"
