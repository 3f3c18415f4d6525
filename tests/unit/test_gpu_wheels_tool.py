"""tools/gpu_wheels.py without the registry: the pinned list, the pip commands it runs (cp312 manylinux,
binary only; DeepSpeed built with DS_BUILD_OPS=0; the project's wheel), the size limit, and that it
replaces only the wheels it wrote before."""

import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SPEC = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "tools" / "gpu_wheels.py")
tool = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(tool)


def test_the_repositorys_list_is_pinned_and_leaves_out_the_images_packages():
    requirements = tool.read_requirements(tool.REQUIREMENTS)
    names = {tool.normalise(r.split("==")[0]) for r in requirements}
    assert {"megatron-core", "deepspeed", "pydantic", "pytest"} <= names
    assert not any(tool.EXCLUDED.match(n) for n in names)


def test_bad_lines_are_named(tmp_path):
    for line, message in (("megatron-core>=0.19", "not pinned"), ("torch==2.11.0", "comes with the CUDA image"),
                          ("nvidia-nccl-cu13==2.28.9", "comes with the CUDA image")):
        path = tmp_path / "req.txt"
        path.write_text(f"# comment\npyyaml==6.0.4\n{line}\n")
        with pytest.raises(ValueError, match=f"req.txt:3: .*{message}"):
            tool.read_requirements(path)
        assert tool.main(["--requirements", str(path), "--out", str(tmp_path / "out")]) == 2


def _fake_pip(outputs: dict):
    """A stand-in for subprocess.run: a pip command naming a target (a requirement, the project's folder)
    writes that target's wheel."""
    calls = []

    def run(cmd, check, env=None):
        calls.append((cmd, env))
        dest = Path(cmd[cmd.index("--dest") + 1] if "--dest" in cmd else cmd[cmd.index("--wheel-dir") + 1])
        for target, name in outputs.items():
            if target in cmd:
                (dest / name).write_bytes(b"\0" * 1024)
        return subprocess.CompletedProcess(cmd, 0)

    return run, calls


def test_build_runs_pip_for_cp312_manylinux_and_replaces_only_its_own_wheels(tmp_path):
    out = tmp_path / "wheels"
    out.mkdir()
    (out / "MANIFEST").write_text("pyyaml-6.0.3-cp312-cp312-manylinux_2_28_x86_64.whl\n")
    (out / "pyyaml-6.0.3-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"old")
    (out / "users_own-1.0-py3-none-any.whl").write_bytes(b"kept")  # not written by the tool: left alone
    run, calls = _fake_pip({"pyyaml==6.0.4": "pyyaml-6.0.4-cp312-cp312-manylinux_2_28_x86_64.whl",
                            "deepspeed==0.19.8": "deepspeed-0.19.8-py3-none-any.whl",
                            str(tool.ROOT): "fbt_megatron-0.1.0-py3-none-any.whl"})
    wheels = tool.build(out, ["pyyaml==6.0.4", "deepspeed==0.19.8"], "3.12", run=run)
    assert sorted(w.name for w in wheels) == ["deepspeed-0.19.8-py3-none-any.whl", "fbt_megatron-0.1.0-py3-none-any.whl",
                                              "pyyaml-6.0.4-cp312-cp312-manylinux_2_28_x86_64.whl",
                                              "users_own-1.0-py3-none-any.whl"]
    download, (deepspeed, ds_env), (project, _) = calls[0][0], calls[1], calls[2]
    assert "--only-binary=:all:" in download and "--no-deps" in download and "deepspeed==0.19.8" not in download
    assert download[download.index("--python-version") + 1] == "3.12" and "cp312" in download
    assert "manylinux_2_28_x86_64" in download and "manylinux2014_x86_64" in download
    assert deepspeed[-1] == "deepspeed==0.19.8" and ds_env["DS_BUILD_OPS"] == "0" and "wheel" in deepspeed
    assert project[-1] == str(tool.ROOT)
    assert (out / "MANIFEST").read_text().split() == ["deepspeed-0.19.8-py3-none-any.whl",
                                                      "fbt_megatron-0.1.0-py3-none-any.whl",
                                                      "pyyaml-6.0.4-cp312-cp312-manylinux_2_28_x86_64.whl"]


def test_over_the_limit_fails_and_says_so(tmp_path, monkeypatch, capsys):
    req = tmp_path / "req.txt"
    req.write_text("numpy==2.4.6\n")
    out = tmp_path / "wheels"

    def fake_build(out_dir, requirements, python_version):
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "numpy-2.4.6-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"\0" * (3 * 2**20))
        return sorted(out_dir.glob("*.whl"))

    monkeypatch.setattr(tool, "build", fake_build)
    assert tool.main(["--requirements", str(req), "--out", str(out), "--limit-mib", "2"]) == 1
    captured = capsys.readouterr()
    assert "3.00  total" in captured.out and "over the 2 MiB" in captured.err
    assert tool.main(["--requirements", str(req), "--out", str(out), "--limit-mib", "4"]) == 0
    assert "1 wheels, 3.0 MiB of 4" in capsys.readouterr().out


def test_a_wheel_the_build_did_not_make_is_named_and_the_next_step_is_the_guides(tmp_path, monkeypatch, capsys):
    """A wheel of yours in --out stays, is counted and named (the GPU check does not install it); the last
    line names the command of docs/guides/first-gpu-run.md."""
    req = tmp_path / "req.txt"
    req.write_text("numpy==2.4.6\n")
    out = tmp_path / "wheels"
    out.mkdir()
    (out / "mine-1.0-py3-none-any.whl").write_bytes(b"mine")

    def fake_build(out_dir, requirements, python_version):
        (out_dir / "numpy-2.4.6-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"\0" * 1024)
        (out_dir / tool.MANIFEST).write_text("numpy-2.4.6-cp312-cp312-manylinux_2_28_x86_64.whl\n")
        return sorted(out_dir.glob("*.whl"))

    monkeypatch.setattr(tool, "build", fake_build)
    assert tool.main(["--requirements", str(req), "--out", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2] == (f"gpu_wheels: {out} also holds mine-1.0-py3-none-any.whl, which this build did not make: "
                         "counted in the size, not installed by the GPU check")
    assert lines[-1].endswith(f"on the GPU machine, from the work tree: python3 benchmarks/gpu_check.py --wheels "
                              f"{out} --budget 480 (docs/guides/first-gpu-run.md)")
    assert (out / "mine-1.0-py3-none-any.whl").read_bytes() == b"mine"
    monkeypatch.setattr(tool, "ROOT", tmp_path / "repo")
    (tmp_path / "repo" / "build" / "gpu-wheels").mkdir(parents=True)
    assert tool.main(["--requirements", str(req), "--out", str(tmp_path / "repo" / "build" / "gpu-wheels")]) == 0
    assert "from the work tree: make gpu-check GPU_PY=python3 (docs" in capsys.readouterr().out
