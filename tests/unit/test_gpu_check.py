"""benchmarks/gpu_check.py on CPU: the refusal and its JSON, the budget and the step statuses, the
wheelhouse install plan, and the parts of the GPU steps a CPU can run (the same-weights builds under the
RNG tracker, the 1B step through DeepSpeed's bf16 engine, the multi-GPU runs' one initial checkpoint)."""

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]
SPEC = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(SPEC)
sys.modules.setdefault("gpu_check", gpu_check)  # its dataclass looks its module up there
SPEC.loader.exec_module(gpu_check)
SINGLE = ["install", "zero1_bf16_resume", "te_packed_vs_mask", "train_1b", "full_recompute", "host_syncs", "gpu_tests"]


def test_refuses_on_cpu_in_one_sentence_and_its_json_lists_every_step(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("FBT_DEVICE", raising=False)
    for argv, names in ((["--budget", "30"], SINGLE), (["--multi"], ["tp2_sp", "pp2_k3", "dp2"])):
        out = tmp_path / argv[0]
        assert gpu_check.main([*argv, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("gpu_check: refusing: no CUDA device"), err
        report = json.loads((out / "gpu_check.json").read_text())
        assert list(report["steps"]) == names
        assert {e["status"] for e in report["steps"].values()} == {"not run"}
        assert all("no CUDA device" in e["reason"] for e in report["steps"].values())
        assert report["summary"]["not run"] == names and report["failed"] == []
    monkeypatch.setenv("FBT_DEVICE", "cpu")
    assert gpu_check.main(["--out", str(tmp_path / "forced")]) == 2
    assert "FBT_DEVICE=cpu" in capsys.readouterr().err


def test_budget_skips_and_stops_steps_and_every_status_reaches_the_json(tmp_path):
    def wrong():
        raise gpu_check.CheckFailed("loss 5 vs 4")

    def crash():
        raise RuntimeError("CUDA error")

    def no_te():
        raise AssertionError("a step needing Transformer Engine ran without it")

    def slow():
        time.sleep(30)

    Step = gpu_check.Step
    steps = [Step("ok", lambda: {"tokens_s": 7.0}, 0.1), Step("wrong", wrong, 0.1), Step("crash", crash, 0.1),
             Step("te", no_te, 0.1, needs_te=True), Step("slow", slow, 0.1), Step("late", lambda: {}, 0.1),
             Step("big", lambda: {}, 1e6)]
    t0 = time.monotonic()
    report = gpu_check.run_steps(steps, tmp_path, budget_s=1.5, print_fn=lambda *a: None,
                                 not_run_reason=lambda s: "no Transformer Engine (ImportError)" if s.needs_te else None)
    assert time.monotonic() - t0 < 10  # the sleeping step was stopped when the budget ran out
    on_disk = json.loads((tmp_path / "gpu_check.json").read_text())
    assert on_disk == json.loads(json.dumps(report, default=str))
    s = on_disk["steps"]
    assert [s[n]["status"] for n in ("ok", "wrong", "crash", "te", "slow", "late", "big")] == \
        ["ok", "failed", "failed", "not run", "skipped", "skipped", "skipped"]
    assert s["ok"]["tokens_s"] == 7.0 and s["wrong"]["error"] == "loss 5 vs 4" and "CUDA error" in s["crash"]["error"]
    assert s["te"]["reason"].startswith("no Transformer Engine")
    assert "stopped after" in s["slow"]["reason"] and "left" in s["late"]["reason"]
    assert on_disk["failed"] == ["wrong", "crash"] and on_disk["summary"]["skipped"] == ["slow", "late", "big"]
    # without a budget nothing is skipped
    report = gpu_check.run_steps([Step("big", lambda: {}, 1e6)], tmp_path, budget_s=None, print_fn=lambda *a: None)
    assert report["steps"]["big"]["status"] == "ok"


def test_without_te_the_te_steps_are_not_run_and_the_rest_run(tmp_path, monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(gpu_check, "refuse_reason", lambda: None)
    monkeypatch.setattr(gpu_check, "te_missing_reason", lambda: "no Transformer Engine (ImportError: no module)")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    names, real_steps = [], gpu_check.single_steps

    def fake_steps(work, wheels, te, peak):
        assert te is False
        real = real_steps(work, wheels, te, peak)
        names.extend((s.name, s.needs_te) for s in real)
        return [gpu_check.Step(s.name, (lambda n=s.name: ran.append(n)), 1.0, needs_te=s.needs_te) for s in real]

    monkeypatch.setattr(gpu_check, "single_steps", fake_steps)
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    te_steps = [n for n, needs in names if needs]
    assert te_steps == ["te_packed_vs_mask", "gpu_tests"]
    assert ran == [n for n, needs in names if not needs]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["summary"]["not run"] == te_steps and report["transformer_engine"].startswith("no Transformer")
    out = capsys.readouterr().out
    assert "estimates" in out and "[Transformer Engine]" in out and "2 not run" in out


def test_estimates_fit_ten_minutes_with_the_install():
    """From a bare box: every step of an H100 (with and without TE) and a 64 MiB wheelhouse in the budget."""
    for te in (True, False):
        steps = gpu_check.single_steps(Path("/nonexistent"), None, te, 989e12)
        assert [s.name for s in steps] == SINGLE
        total = sum(s.estimate_s for s in steps if te or not s.needs_te) + gpu_check.PIP_S_PER_MIB * 64
        assert total <= gpu_check.DEFAULT_BUDGET_S, (te, total)
        assert all(s.estimate_s > 0 and s.parts for s in steps)


def test_wheelhouse_install_keeps_what_the_image_has(tmp_path):
    wheels = [tmp_path / n for n in ("fbt_megatron-0.1.0-py3-none-any.whl", "numpy-2.4.6-cp312-cp312-x.whl",
                                      "megatron_core-0.19.2-cp312-cp312-x.whl", "PyYAML-6.0.4-cp312-cp312-x.whl")]
    chosen = gpu_check.wheels_to_install(wheels, {"numpy", "fbt-megatron", "pyyaml", "torch"})
    assert [w.name for w in chosen] == ["fbt_megatron-0.1.0-py3-none-any.whl", "megatron_core-0.19.2-cp312-cp312-x.whl"]
    with pytest.raises(gpu_check.CheckFailed, match="torch"):
        gpu_check.wheels_to_install(wheels + [tmp_path / "torch-2.11.0-cp312-cp312-x.whl"], set())
    with pytest.raises(gpu_check.NotRun, match="no wheelhouse"):
        gpu_check.install_wheelhouse(tmp_path / "absent")  # this Python has every module the check needs


def test_the_check_installs_only_the_wheels_the_build_listed(tmp_path, monkeypatch):
    """make gpu-wheels lists its wheels in MANIFEST: a wheel left beside them is not installed; a folder
    made by hand (no MANIFEST) is installed whole."""
    for name in ("numpy-2.4.6-cp312-cp312-x.whl", "fbt_megatron-0.1.0-py3-none-any.whl", "mine-1.0-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"w")
    assert [w.name for w in gpu_check.wheelhouse_wheels(tmp_path)] == [
        "fbt_megatron-0.1.0-py3-none-any.whl", "mine-1.0-py3-none-any.whl", "numpy-2.4.6-cp312-cp312-x.whl"]
    (tmp_path / "MANIFEST").write_text("fbt_megatron-0.1.0-py3-none-any.whl\nnumpy-2.4.6-cp312-cp312-x.whl\n")
    assert [w.name for w in gpu_check.wheelhouse_wheels(tmp_path)] == [
        "fbt_megatron-0.1.0-py3-none-any.whl", "numpy-2.4.6-cp312-cp312-x.whl"]
    pip = []
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda cmd, **kw: pip.append(cmd) or
                        subprocess.CompletedProcess(cmd, 0, "", ""))
    monkeypatch.setattr(gpu_check, "installed_distributions", lambda: set())
    monkeypatch.setattr(gpu_check, "missing_modules", lambda: [])
    assert gpu_check.install_wheelhouse(tmp_path)["installed"] == [
        "fbt_megatron-0.1.0-py3-none-any.whl", "numpy-2.4.6-cp312-cp312-x.whl"]
    assert not any("mine-1.0" in arg for arg in pip[0])
    (tmp_path / "numpy-2.4.6-cp312-cp312-x.whl").unlink()  # a copy that lost a wheel: named, nothing installed
    with pytest.raises(gpu_check.CheckFailed, match="lacks numpy-2.4.6-cp312-cp312-x.whl, which its MANIFEST lists"):
        gpu_check.install_wheelhouse(tmp_path)
    assert len(pip) == 1


def test_gpu_tests_collect_only_the_files_with_gpu_tests():
    files = gpu_check.gpu_test_files()
    assert "tests/unit/test_model_packed_attention.py" in files and "tests/unit/test_gpu_smoke.py" in files
    assert all("mark.gpu" in (ROOT / f).read_text() for f in files)


def test_same_weights_builds_under_the_rng_tracker(single_process, monkeypatch):
    """On a GPU Megatron draws the weights inside its RNG tracker (``use_cpu_initialization=False``); on CPU
    the same code path runs on runtime's CPU tracker. torch.manual_seed does not reset the tracker, so two
    builds differ; build_on_same_weights gives the second the first one's weights."""
    from fbt_megatron.model import fbt_gpt
    from tests.support.model_helpers import LLAMA, feedback, loss_and_grads, tiny_model_config

    real_config = fbt_gpt.transformer_config

    def gpu_style_config(*args, **kwargs):
        config = real_config(*args, **kwargs)
        config.use_cpu_initialization = False  # Megatron's GPU initialisation: weights from the tracker
        return config

    monkeypatch.setattr(fbt_gpt, "transformer_config", gpu_style_config)
    config = tiny_model_config(**LLAMA)

    def build(recompute):
        torch.manual_seed(0)  # what the GPU check did
        return fbt_gpt.build_model(config.model_copy(update={"recompute": recompute}), feedback()).train()

    plain = [dict(build("none").named_parameters()), dict(build("none").named_parameters())]
    qkv = "gpt.decoder.layers.0.self_attention.linear_qkv.weight"
    assert not torch.equal(plain[0][qkv], plain[1][qkv])  # the false comparison the check made
    models = dict(gpu_check.build_on_same_weights(build, ("none", "full")))
    first, second = (dict(m.named_parameters()) for m in models.values())
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    (l0, g0), (l1, g1) = (loss_and_grads(models[m], 2) for m in ("none", "full"))
    torch.testing.assert_close(l1, l0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name])


def test_1b_step_goes_through_deepspeeds_bf16_engine(single_process):
    """train_1b times the step fbt train runs: FBTTrainStep over DeepSpeed ZeRO-1 in bf16, fp32 masters."""
    spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "benchmarks" / "gpu_smoke.py")
    gpu_smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_smoke)
    from fbt_megatron.recipe import load_recipe
    from tests.support.model_helpers import LLAMA

    model = {k: v for k, v in LLAMA.items()}
    recipe = load_recipe(data={"model": {**model, "max_sequence_length": 16}, "data": {"seq_length": 16, "synthetic": {"vocab_size": 64}},
                               "batch": {"global_batch_size": 8, "micro_batch_size": 4}})
    rows = gpu_smoke.train_steps(recipe, (1, 2), 2, 2, gpu=None)
    assert list(rows) == [1, 2]
    for r in rows.values():
        assert r["optimizer"] == "BF16_Optimizer" and r["master_dtypes"] == ["float32"]
        assert len(r["losses"]) == 3 and all(x == x for x in r["losses"]) and r["step_s"] > 0
    trained = gpu_smoke.engine_recipe(recipe, 2)
    assert (trained.parallel.zero_stage, trained.resolved_precision(), trained.global_batch_size) == (1, "bf16", 2)


def test_multi_gpu_runs_start_from_one_checkpoint(tmp_path):
    """tp2_sp / pp2_k3 / dp2: the single-GPU run and the multi-GPU run both start from the checkpoint a
    one-step run saves (init_from), in fp32, and are compared at 1e-3."""
    initial, single, multi = gpu_check.against_single_recipes(tmp_path, "tp2_sp", {"tensor": 2, "sequence_parallel": True})
    assert initial["checkpoint"]["at_end"] and initial["train"]["steps"] == 1 and "init_from" not in initial
    assert single["init_from"] == multi["init_from"] == initial["run_dir"]
    assert single["run_dir"] != multi["run_dir"] != initial["run_dir"]
    assert {r["precision"] for r in (initial, single, multi)} == {"fp32"}
    assert multi["parallel"]["tensor"] == 2 and single["parallel"]["tensor"] == 1
    from fbt_megatron.recipe import load_recipe

    for data in (initial, single, multi):
        load_recipe(data=data)  # valid recipes
    history = lambda losses: {"history": [[i, 1, x] for i, x in enumerate(losses)]}  # noqa: E731
    assert gpu_check.compare_to_single("tp2_sp", history([4.0, 3.0]), history([4.0, 3.002]))["max_rel_diff"] < 1e-3
    with pytest.raises(gpu_check.CheckFailed, match="tolerance 0.001"):
        gpu_check.compare_to_single("tp2_sp", history([4.0, 3.0]), history([4.0, 3.01]))
