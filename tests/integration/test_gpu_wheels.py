"""`make gpu-wheels` builds a wheelhouse (<= 64 MiB) that installs offline (pip --no-index, no config files)
into a clean Python 3.12 that already holds torch 2.11 (a CUDA image's stand-in: tests/support/gpu_image_env.py),
keeps that torch, and from which the project, its engine and the GPU check import. On this CPU, fbt train
then trains the tiny model there in bf16 with ZeRO-1 (what the check's resume step runs), and the check
refuses in one sentence, its JSON listing every step as not run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import gpu_image_env

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
IMPORTS = ("import fbt_megatron, megatron.core, deepspeed, pydantic, yaml, numpy, pytest, torch; "
           "from fbt_megatron.engine import Engine; from fbt_megatron.model.fbt_gpt import build_model; "
           "from fbt_megatron.train.run import train; "
           "print(fbt_megatron.__file__, megatron.core.__version__, deepspeed.__version__, torch.__version__, torch.__file__)")


def _offline_env(**extra) -> dict:
    """pip with no index and no config file (this machine's pip.conf names local indexes); CUDA unseen."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "FBT_", "DS_", "PYTHON"))}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "CUDA_VISIBLE_DEVICES": "", **extra}


def _run(cmd, cwd, env, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-wheels")
    r = _run([sys.executable, "tools/gpu_wheels.py", "--out", out], REPO, dict(os.environ), timeout=1800)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return out, r.stdout


@pytest.mark.timeout(2400)  # a wheelhouse build, a venv, an install and a tiny training run: ~15 min on a loaded 2-core box
def test_wheelhouse_installs_offline_beside_the_images_torch(wheelhouse, tmp_path):
    out, printed = wheelhouse
    wheels = sorted(out.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels) / 2**20
    assert total <= 64 and f"{total:.2f}  total" in printed
    names = {gpu_image_env_name(w.name) for w in wheels}
    assert {"fbt-megatron", "megatron-core", "deepspeed", "pydantic", "pytest"} <= names
    assert not {n for n in names if n in ("torch", "triton") or n.startswith(("nvidia-", "transformer-engine"))}
    assert [w for w in wheels if w.name.startswith("deepspeed-")][0].name.endswith("-py3-none-any.whl")
    try:
        python = gpu_image_env.fresh_env(tmp_path / "image")
    except gpu_image_env.Unavailable as e:
        pytest.skip(f"no Python 3.12 environment with torch here: {e}")
    env = _offline_env()
    before = _run([python, "-c", "import torch; print(torch.__version__, torch.__file__)"], tmp_path, env)
    assert before.returncode == 0 and before.stdout.startswith("2.11.0"), before.stderr[-2000:]

    install = ("import json, sys; sys.path.insert(0, 'benchmarks'); import gpu_check; from pathlib import Path; "
               f"print(json.dumps(gpu_check.install_wheelhouse(Path({str(out)!r}))))")
    r = _run([python, "-c", install], REPO, env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    installed = json.loads(r.stdout.strip().splitlines()[-1])
    assert "fbt_megatron-0.1.0-py3-none-any.whl" in installed["installed"]
    assert not any(w.startswith("typing_extensions") for w in installed["installed"])  # torch's: kept

    # outside the checkout: the installed wheels alone, torch still the image's
    r = _run([python, "-c", IMPORTS], tmp_path, env)
    assert r.returncode == 0, r.stderr[-3000:]
    fbt_file, megatron_version, ds_version, torch_version, torch_file = r.stdout.split()[-5:]
    assert str(tmp_path / "image") in fbt_file and megatron_version == "0.19.2" and ds_version == "0.19.8"
    assert f"{torch_version} {torch_file}" == before.stdout.strip()

    # what the check's zero1_bf16_resume step runs, on this CPU: fbt train in bf16 with ZeRO-1 (BF16_Optimizer)
    sys.path.insert(0, str(REPO / "benchmarks"))
    from harness import tiny_recipe

    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(json.dumps(tiny_recipe(str(tmp_path / "run"), precision="bf16", train={"steps": 2},
                                             parallel={"tensor": 1, "zero_stage": 1})))
    r = _run([python, "-m", "fbt_megatron.cli", "train", recipe], tmp_path, _offline_env(FBT_DEVICE="cpu"))
    assert r.returncode == 0 and "steps             2/2" in r.stdout, (r.stdout + r.stderr)[-3000:]

    report = tmp_path / "report"
    r = _run([python, "benchmarks/gpu_check.py", "--wheels", out, "--budget", "60", "--out", report], REPO, env)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "refusing: no CUDA device" in r.stderr
    steps = json.loads((report / "gpu_check.json").read_text())["steps"]
    assert steps and {e["status"] for e in steps.values()} == {"not run"}


def gpu_image_env_name(filename: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", filename.split("-")[0]).lower()
