"""tools/install_in_cuda_env.py installs into an existing CUDA environment without replacing its torch,
TE or apex: the package with --no-deps, its other requirements under constraints that pin what the
environment built against its CUDA."""

import importlib.util
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SPEC = importlib.util.spec_from_file_location("install_in_cuda_env", ROOT / "tools" / "install_in_cuda_env.py")
tool = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(tool)
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
NGC = {"torch": "2.8.0a0+5228986c39.nv25.05", "transformer-engine": "2.4.0+3cd6870", "apex": "0.1",
       "triton": "3.3.0"}


def test_an_ngc_environment_keeps_its_torch_te_and_apex():
    requirements, constraints = tool.install_plan(PROJECT["dependencies"], NGC, PROJECT["optional-dependencies"])
    names = [tool._name(r) for r in requirements]
    assert "torch" not in names and not any(n.startswith("transformer-engine") for n in names)
    assert "megatron-core" in names and "deepspeed" in names  # everything else the project needs
    assert "pytest" in names and "pytest-timeout" in names  # the GPU check's first step runs pytest
    assert len(requirements) == len(PROJECT["dependencies"]) - 1 + 2
    assert constraints == ["apex==0.1", "torch==2.8.0a0+5228986c39.nv25.05", "transformer-engine==2.4.0+3cd6870",
                           "triton==3.3.0"]
    first, second = tool.commands(requirements, Path("/tmp/c.txt"))
    assert first[-3:] == ["--no-deps", "-e", str(ROOT)]  # the package alone
    assert second[second.index("-c") + 1] == "/tmp/c.txt" and second[-len(requirements):] == requirements


def test_transformer_engine_from_pypi_only_where_the_environment_has_none():
    requirements, constraints = tool.install_plan(PROJECT["dependencies"], {"torch": "2.13.0+cu128"},
                                                  PROJECT["optional-dependencies"], ["eval"])
    te = [r for r in requirements if tool._name(r).startswith("transformer-engine")]
    assert te == PROJECT["optional-dependencies"]["gpu"] and constraints == ["torch==2.13.0+cu128"]
    assert all(">=2.9" in r for r in te)  # megatron-core 0.16.1 asks >=2.9,<2.12
    assert "pytest" in [tool._name(r) for r in requirements]
    assert any(tool._name(r) == "lm-eval" for r in requirements)
    with pytest.raises(ValueError, match="unknown extra 'gpus'"):
        tool.install_plan(PROJECT["dependencies"], NGC, PROJECT["optional-dependencies"], ["gpus"])


def test_dry_run_on_this_environment(capsys):
    import shutil

    lines, printed, constraints_file = _dry_run(capsys)
    shutil.rmtree(constraints_file.parent)
    assert "torch==" in lines[0] and "--no-deps -e" in printed[0] and " -c " in printed[1]


def _dry_run(capsys, *args):
    """The dry run's output lines, its printed commands as bash would run them, and the constraints file."""
    assert tool.main(["--dry-run", *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    kept = [line for line in lines if line.startswith("constraints file (kept for the second command; remove its "
                                                        "folder when done): ")]
    assert len(kept) == 1
    return lines, [line[2:] for line in lines if line.startswith("$ ")], Path(kept[0].rsplit(": ", 1)[1])


def test_the_printed_commands_paste_into_a_shell_as_the_exact_arguments_it_runs(capsys):
    """Each printed command, split as a shell does, is the argument list the tool runs: the requirements'
    ``>=``, ``<``, ``;`` and quotes are quoted (unquoted, bash made files named ``=`` and failed)."""
    import shlex
    import shutil
    import subprocess

    lines, printed, constraints_file = _dry_run(capsys, "--extras", "eval")
    try:
        requirements, constraints = tool.install_plan(PROJECT["dependencies"], tool.installed_versions(),
                                                      PROJECT["optional-dependencies"], ["eval"])
        expected = tool.commands(requirements, constraints_file)
        assert [shlex.split(cmd) for cmd in printed] == expected
        assert any(";" in r and "'" in r for r in requirements)  # the markers that broke the unquoted paste
        # and bash itself: the same words, nothing redirected
        for cmd, args in zip(printed, expected):
            words = subprocess.run(["bash", "-c", "printf '%s\\0' " + cmd], capture_output=True, text=True,
                                   cwd=constraints_file.parent, check=True).stdout.split("\0")[:-1]
            assert words == args
        assert sorted(p.name for p in constraints_file.parent.iterdir()) == ["constraints.txt"]
        # the file the printed command reads is there, and the output says it is kept for it
        assert constraints_file.read_text().splitlines() == constraints
    finally:
        shutil.rmtree(constraints_file.parent)


def test_help_lists_every_extra_the_tool_accepts(capsys):
    with pytest.raises(SystemExit):
        tool.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    listed = help_text.split("comma-separated optional extras (", 1)[1].split(")", 1)[0].split(", ")
    assert listed == sorted(PROJECT["optional-dependencies"])  # what install_plan accepts
    for extra in listed:
        tool.install_plan(PROJECT["dependencies"], NGC, PROJECT["optional-dependencies"], [extra])


def test_an_install_removes_its_constraints_file_and_a_refused_extra_writes_none(capsys, monkeypatch, tmp_path):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = []

    def fake_pip(cmd, **kw):
        if "-c" in cmd:
            seen.append(Path(cmd[cmd.index("-c") + 1]).read_text())  # there while pip runs
        return tool.subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(tool.subprocess, "run", fake_pip)
    assert tool.main([]) == 0
    assert len(seen) == 1 and "torch==" in seen[0] and list(tmp_path.iterdir()) == []  # gone afterwards

    assert tool.main(["--dry-run", "--extras", "gpus"]) == 2
    assert capsys.readouterr().err.startswith("install_in_cuda_env: unknown extra 'gpus'")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_pip_is_one_sentence_and_stops(capsys, monkeypatch, tmp_path):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    calls = []
    monkeypatch.setattr(tool.subprocess, "run",
                        lambda cmd, **kw: calls.append(cmd) or tool.subprocess.CompletedProcess(cmd, 1))
    assert tool.main([]) == 1
    assert len(calls) == 1 and list(tmp_path.iterdir()) == []
    assert capsys.readouterr().err == ("install_in_cuda_env: pip exited with status 1 (its messages are above); the "
                                       "commands after it did not run\n")
