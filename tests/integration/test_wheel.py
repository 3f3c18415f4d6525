"""A wheel built from the repository works from a normal install: it ships the SLURM template and the
other package data, and `fbt --version` / `fbt slurm submit --dry-run` run from it (outside the
repository, nothing of the checkout on the path).

The fresh venv gets the wheel only; its dependencies (torch, megatron-core, ... : gigabytes, offline)
are borrowed from the running environment through a .pth line, which adds that site-packages directory
without processing its own .pth files, so the editable install of the checkout stays invisible."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IGNORE = shutil.ignore_patterns(".git", ".venv", "runs", "data", "build", "dist", "*.egg-info", "__pycache__",
                                ".pytest_cache")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=IGNORE, symlinks=True)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    wheel = next((tmp / "dist").glob("fbt_megatron-*.whl"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
                        str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "_borrowed_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(FBT_DEVICE="cpu", DS_ACCELERATOR="cpu")
    work = tmp / "work"
    work.mkdir()
    return wheel, venv, env, work


def test_wheel_ships_the_package_data_and_no_test_code(installed):
    wheel, *_ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in ("fbt_megatron/launch/train.sbatch", "fbt_megatron/eval/tasks/fbt_humaneval.yaml",
                 "fbt_megatron/eval/tasks/fbt_tasks.py", "fbt_megatron/model/modeling_fbt.py",
                 "fbt_megatron/model/feedback_rule.py", "data_pipeline/cli.py"):
        assert path in names, path
    # test support lives in tests/support (and what the benchmarks share with it in benchmarks/), not in the wheel
    shipped_tests = sorted(n for n in names if n.startswith(("tests/", "benchmarks/", "tools/"))
                           or "/testing" in n or "_helpers" in n or n.rsplit("/", 1)[-1].startswith(("test_", "conftest")))
    assert not shipped_tests, shipped_tests
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"fbt_megatron", "data_pipeline"}


def test_fbt_runs_from_the_wheel(installed):
    wheel, venv, env, work = installed
    fbt = str(venv / "bin" / "fbt")
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import fbt_megatron; print(fbt_megatron.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr  # the wheel, not the checkout
    r = subprocess.run([fbt, "--version"], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "fbt_megatron 0.1.0", r.stdout + r.stderr
    shutil.copy(ROOT / "recipes" / "tiny.yaml", work / "my.yaml")  # a user's recipe, outside the repository
    r = subprocess.run([fbt, "slurm", "submit", "my.yaml", "--gpus-per-node", "1", "--cpu", "--dry-run"],
                       cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "#SBATCH --job-name=tiny" in r.stdout and "--rdzv-backend=c10d" in r.stdout and "{{" not in r.stdout
