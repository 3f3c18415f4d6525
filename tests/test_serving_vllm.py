"""Serving exports with vLLM (issue 25): the `--standard` export in stock vLLM, latent feedback through the
fbt_megatron vLLM plugin (FUSED and exact prefill), and a feedback export refused without the plugin.

vLLM's CPU build runs in a venv of its own (tests/vllm_env.py: built once and cached; skipped with the reason
where it cannot be installed, a failure with CI=true). Its side of each test is tests/vllm_side.py, run as
a fresh process with HF_HUB_OFFLINE=1: the plugin is found through its entry point (declared from
pyproject.toml by ``vllm_env.plugin_path``), or, for the refusal, not at all.

The model: a stock Llama (head dimension 32, the smallest vLLM's CPU attention serves) imported with a fresh
GLU fusion and prefix mixin 0.1, so the feedback path is live, exported both ways. The reference tokens are
the project's own generator's (``FeedbackDecoder``, what ``fbt generate`` runs) on the imported checkpoint,
for a batch of prompts of different lengths, greedy.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

import vllm_env

pytestmark = pytest.mark.timeout(3600)  # the first run builds the vLLM venv (~15 min on a loaded machine)

SIDE = Path(__file__).with_name("vllm_side.py")
VOCAB = 320  # = the sentencepiece tokenizer's pieces: the framework and vLLM choose among the same ids
PROMPTS = [[5, 17, 30, 44, 9], [100, 7], [3, 200, 250, 12, 40, 41, 42, 60, 61, 70, 80], [77]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def vllm_python():
    try:
        return vllm_env.ensure()
    except vllm_env.Unavailable as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must test vLLM serving: {e}")
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(run dir, feedback export, --standard export, reference tokens by mode)."""
    from test_hf_convert import _sp_tokenizer
    from test_hf_first_use import _llama

    from fbt_megatron import runtime
    from fbt_megatron.generate.decoder import FeedbackDecoder
    from fbt_megatron.generate.loading import load_for_inference
    from fbt_megatron.generate.sampling import SamplingParams
    from fbt_megatron.hf.export import export_checkpoint
    from fbt_megatron.hf.importer import import_hf

    root = tmp_path_factory.mktemp("serving")
    _llama(root / "llama", num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=128)
    sp = _sp_tokenizer(root / "tok" / "tokenizer.model")
    runtime.init_distributed()
    try:
        import_hf(root / "llama", root / "run", log=lambda *a: None)
        export_checkpoint(root / "run", root / "hf", tokenizer=sp, log=lambda *a: None)
        export_checkpoint(root / "run", root / "std", tokenizer=sp, standard=True, log=lambda *a: None)
        net = load_for_inference(root / "run", need_tokenizer=False).model
        params = SamplingParams(max_new_tokens=NEW_TOKENS)
        refs = {name: FeedbackDecoder(net, mode, passes).generate(PROMPTS, params).tokens
                for name, mode, passes in [("standard", "standard", 1), ("fused", "feedback", 2),
                                           ("exact", "feedback", "exact")]}
    finally:
        runtime.shutdown()
    assert len({json.dumps(r) for r in refs.values()}) == 3, refs  # the three decodings differ on this model
    return root / "run", root / "hf", root / "std", refs


def run_side(python: Path, jobs: list[dict], tmp: Path, plugin: bool) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "request.json").write_text(json.dumps({"jobs": jobs}))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_PLUGINS")}
    repo = str(vllm_env.REPO)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp / "hf_home"), OMP_NUM_THREADS="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind",
               PYTHONPATH=f"{vllm_env.plugin_path(tmp / 'plugin')}:{repo}" if plugin else repo)
    proc = subprocess.run([str(python), str(SIDE), str(tmp / "request.json"), str(tmp / "result.json")],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    return json.loads((tmp / "result.json").read_text())


def job(name, model, **kw):
    return {"name": name, "model": str(model), "prompts": PROMPTS, "max_tokens": NEW_TOKENS, **kw}


def test_stock_vllm(model, vllm_python, tmp_path):
    """Stock vLLM, no plugin: the `--standard` export (a plain Llama) gives `fbt generate --mode standard`'s
    greedy tokens for a batch of prompts of different lengths; the feedback export is refused with a message
    that names the plugin (vLLM's Transformers backend would otherwise run it without feedback)."""
    run, hf, std, refs = model
    res = run_side(vllm_python, [job("standard", std),
                                 job("feedback_without_plugin", hf, engine={"trust_remote_code": True}, error=True)],
                   tmp_path, plugin=False)
    assert res["standard"]["tokens"] == refs["standard"]
    err = res["feedback_without_plugin"]["error"]
    assert err is not None and "fbt_megatron vLLM plugin" in err and "vllm.general_plugins" in err, err


def test_plugin_feedback(model, vllm_python, tmp_path):
    """The plugin (found through pyproject's entry point, no --trust-remote-code): latent feedback with FUSED
    prefill (the export's default) and with the exact prefill (`--hf-overrides`) give `fbt generate`'s tokens
    in the same mode for a batch of prompts of different lengths; `feedback_decoding: standard` gives the
    standard tokens."""
    run, hf, std, refs = model
    res = run_side(vllm_python, [job("fused", hf), job("exact", hf, engine={"hf_overrides": {"prefill_passes": "exact"}}),
                                 job("standard", hf, engine={"hf_overrides": {"feedback_decoding": "standard"}})],
                   tmp_path, plugin=True)
    assert res["fused"]["tokens"] == refs["fused"]
    assert res["exact"]["tokens"] == refs["exact"]
    assert res["standard"]["tokens"] == refs["standard"]
