"""benchmarks/gpu_smoke.py refuses clearly where there is no GPU path to measure, and its TE -> local
weight mapping names every local-spec parameter."""

import importlib.util
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("gpu_smoke", Path(__file__).parents[2] / "benchmarks" / "gpu_smoke.py")
gpu_smoke = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(gpu_smoke)


def test_refuses_on_cpu(capsys, monkeypatch):
    monkeypatch.setenv("FBT_DEVICE", "cpu")
    assert gpu_smoke.main([]) == 2
    err = capsys.readouterr().err
    assert "gpu_smoke: refusing" in err and "FBT_DEVICE=cpu" in err
    monkeypatch.delenv("FBT_DEVICE")
    import torch

    if not torch.cuda.is_available():
        assert gpu_smoke.main([]) == 2
        assert "no CUDA GPU here" in capsys.readouterr().err


def test_te_norm_names_map_to_the_local_spec():
    te = {"gpt.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": 1,
          "gpt.decoder.layers.0.self_attention.linear_qkv.weight": 2,
          "gpt.decoder.layers.0.mlp.linear_fc1.layer_norm_weight": 3,
          "gpt.decoder.layers.0.mlp.linear_fc1.layer_norm_bias": 4,
          "gpt.decoder.layers.0.self_attention.core_attention._extra_state": 5}
    assert gpu_smoke.local_weights_from_te(te) == {
        "gpt.decoder.layers.0.input_layernorm.weight": 1, "gpt.decoder.layers.0.self_attention.linear_qkv.weight": 2,
        "gpt.decoder.layers.0.pre_mlp_layernorm.weight": 3, "gpt.decoder.layers.0.pre_mlp_layernorm.bias": 4}


@pytest.mark.gpu
def test_smoke_runs_on_gpu(cuda_device):
    reason = gpu_smoke.refuse_reason()  # decided when the test runs, in this session's environment
    if reason:
        pytest.skip(reason)
    assert gpu_smoke.main(["--steps", "2", "--passes", "1,3", "model.num_layers=2"]) == 0


def test_session_device_decision():
    """The suite runs the CPU path, except a session of the GPU tests alone on a CUDA machine; a caller's
    FBT_DEVICE always wins; a GPU test says why it skips."""
    from tests.support.gpu import gpu_skip_reason, session_env

    cpu = {"FBT_DEVICE": "cpu", "DS_ACCELERATOR": "cpu"}
    assert session_env("", {}, cuda_available=True) == cpu
    assert session_env("", {}, cuda_available=False) == cpu
    assert session_env("not gpu", {}, cuda_available=True) == cpu
    assert session_env("gpu", {}, cuda_available=True) == {}
    assert session_env("gpu", {}, cuda_available=False) == cpu
    assert session_env("", {"FBT_DEVICE": "cuda"}, cuda_available=True) == {}
    assert session_env("gpu", {"FBT_DEVICE": "cpu"}, cuda_available=True) == {}
    assert "no CUDA device" in gpu_skip_reason(use_cuda=False, cuda_available=False)
    assert "pytest -m gpu" in gpu_skip_reason(use_cuda=False, cuda_available=True)
    assert gpu_skip_reason(use_cuda=True, cuda_available=True) is None
