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
    assert len(requirements) == len(PROJECT["dependencies"]) - 1 + 2  # + pytest, pytest-timeout (the GPU check)
    assert "pytest" in names and "pytest-timeout" in names
    assert constraints == ["apex==0.1", "torch==2.8.0a0+5228986c39.nv25.05", "transformer-engine==2.4.0+3cd6870",
                           "triton==3.3.0"]
    first, second = tool.commands(requirements, Path("/tmp/c.txt"))
    assert first[-3:] == ["--no-deps", "-e", str(ROOT)]  # the package alone
    assert second[second.index("-c") + 1] == "/tmp/c.txt" and second[-len(requirements):] == requirements


def test_transformer_engine_from_pypi_only_where_the_environment_has_none():
    requirements, constraints = tool.install_plan(PROJECT["dependencies"], {"torch": "2.13.0+cu128"},
                                                  PROJECT["optional-dependencies"], ["eval"])
    assert tool.TE_REQUIREMENT in requirements and constraints == ["torch==2.13.0+cu128"]
    assert any(tool._name(r) == "lm-eval" for r in requirements)
    with pytest.raises(ValueError, match="unknown extra 'gpus'"):
        tool.install_plan(PROJECT["dependencies"], NGC, PROJECT["optional-dependencies"], ["gpus"])


def test_dry_run_on_this_environment(capsys):
    assert tool.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "torch==" in out and "--no-deps -e" in out and " -c " in out
