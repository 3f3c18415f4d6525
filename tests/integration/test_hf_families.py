"""`fbt convert from-hf` / `to-hf` on the stock families beside Llama 2: Llama 3.x (``llama3`` RoPE
scaling, GQA, tied embeddings as Llama 3.2 1B/3B), Qwen2 (q/k/v biases) and Mistral (the Llama
architecture under its own model_type). Each tiny model is built by transformers with random weights,
offline; the reference is transformers' own forward.

For each family: the imported model's first pass equals transformers' logits (fp32, <= 1e-5 relative);
the FBT export carries the family's config fields back and its 1-pass logits are the stock ones; the
``--standard`` export loads as the family's own transformers class with the stock logits. Fields the
Megatron block cannot compute (a sliding window, another RoPE scaling, another head_dim) are refused
by name, before anything is written.
"""

import json
from pathlib import Path

import pytest
import torch

from fbt_megatron.hf.mapping import ConversionError

VOCAB = 200
IDS = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(5))
# Llama 3.x scaling with original_max_position_embeddings small enough that, at head_dim 16 and theta
# 500000, one frequency is smoothed, four are divided by the factor and one is kept (all three branches).
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, head_dim=16)
FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                   use_sliding_window=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(tie_word_embeddings=False, sliding_window=None,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}
# Fields that must come back unchanged in both exports (those the family's config has).
CARRIED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
           "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "vocab_size", "head_dim")


def _stock(family: str, path: Path):
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **extra)).eval()
    with torch.no_grad():  # non-trivial norms and biases (transformers initialises them to 1 and 0)
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _rope(cfg: dict) -> dict:
    return {k: v for k, v in cfg["rope_parameters"].items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_imports_and_exports(family, tmp_path, single_process):
    import transformers
    from transformers import AutoModelForCausalLM

    from fbt_megatron.hf.checkpoint_io import load_framework_model
    from fbt_megatron.hf.export import export_checkpoint
    from fbt_megatron.hf.importer import import_hf
    from fbt_megatron.model.modeling_fbt import FBTForCausalLM

    stock = _stock(family, tmp_path / "stock")
    source = json.loads((tmp_path / "stock" / "config.json").read_text())
    with torch.no_grad():
        theirs = stock(IDS).logits
    import_hf(tmp_path / "stock", tmp_path / "run", log=lambda *a: None)
    model = load_framework_model(tmp_path / "run")
    with torch.no_grad():
        assert rel(model(IDS, num_passes=1).logits[..., :VOCAB], theirs) < 1e-5
        ours2 = model(IDS, num_passes=2).logits[..., :VOCAB]

    export_checkpoint(tmp_path / "run", tmp_path / "fbt", log=lambda *a: None)
    fbt_cfg = json.loads((tmp_path / "fbt" / "config.json").read_text())
    assert {k: fbt_cfg.get(k) for k in CARRIED} == {k: source.get(k) for k in CARRIED}
    assert _rope(fbt_cfg) == _rope(source)
    assert fbt_cfg["qkv_bias"] == (family == "qwen2")
    exported = FBTForCausalLM.from_pretrained(tmp_path / "fbt").eval()  # the shipped modelling file
    with torch.no_grad():
        assert rel(exported(IDS, num_passes=1).logits, theirs) < 1e-5
        assert rel(exported(IDS, num_passes=2).logits, ours2) < 1e-5

    export_checkpoint(tmp_path / "run", tmp_path / "std", standard=True, log=lambda *a: None)
    std_cfg = json.loads((tmp_path / "std" / "config.json").read_text())
    assert std_cfg["model_type"] == source["model_type"] and std_cfg["architectures"] == source["architectures"]
    assert {k: std_cfg.get(k) for k in CARRIED} == {k: source.get(k) for k in CARRIED}
    assert _rope(std_cfg) == _rope(source)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "std").eval()  # no remote code
    assert type(back) is getattr(transformers, FAMILIES[family][1])
    with torch.no_grad():
        assert rel(back(IDS).logits, theirs) < 1e-5


def _edited(tmp_path: Path, family: str, **fields) -> Path:
    src = tmp_path / family
    if not src.exists():
        _stock(family, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(fields)
    (src / "config.json").write_text(json.dumps(cfg))
    return src


@pytest.mark.parametrize("family, fields, message", [
    ("mistral", {"sliding_window": 32}, r"sliding_window=32 \(max_position_embeddings=256\)"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16}, r"sliding_window=16"),
    ("qwen2", {"layer_types": ["sliding_attention", "full_attention"]}, r"layer_types lists \['sliding_attention'\]"),
    ("llama3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}},
     r"rope_parameters.rope_type='yarn'"),
    ("llama3", {"head_dim": 32}, r"head_dim=32 differs"),
    ("mistral", {"model_type": "mixtral"}, r"model_type='mixtral' cannot be imported"),
])
def test_unsupported_fields_are_refused_by_name(family, fields, message, tmp_path):
    from fbt_megatron.hf.importer import import_hf

    src = _edited(tmp_path, family, **fields)
    with pytest.raises(ConversionError, match=message):
        import_hf(src, tmp_path / "out", log=lambda *a: None)
    assert not (tmp_path / "out").exists()


def test_mistral_window_covering_the_context_imports(tmp_path):
    """A sliding window at least as long as the context is full attention: not refused."""
    from fbt_megatron.hf.families import normalise

    cfg = dict(COMMON, model_type="mistral", sliding_window=256)
    assert normalise(cfg, "config.json")["sliding_window"] == 256


def test_family_exports_under_oldest_transformers(tmp_path, single_process):
    """Both exports of every family under the oldest supported transformers (4.57, which reads
    ``rope_scaling`` and ``rope_theta`` where 5.x reads ``rope_parameters``): the family's class and the
    stock model's logits (the reference computed by the running 5.x)."""
    import os
    import subprocess
    import sys

    from tests.support import SIDE_SCRIPTS, transformers_envs

    from fbt_megatron.hf.export import export_checkpoint
    from fbt_megatron.hf.importer import import_hf

    try:
        python = transformers_envs.ensure("4.57.6")
    except transformers_envs.Unavailable as e:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):  # CI must test the whole range
            pytest.fail(f"transformers 4.57.6: {e}")
        pytest.skip(str(e))
    refs, exports = {}, []
    for family in FAMILIES:
        with torch.no_grad():
            refs[family] = _stock(family, tmp_path / family / "stock")(IDS).logits
        import_hf(tmp_path / family / "stock", tmp_path / family / "run", log=lambda *a: None)
        for kind, standard in (("fbt", False), ("std", True)):
            export_checkpoint(tmp_path / family / "run", tmp_path / family / kind, standard=standard,
                              log=lambda *a: None)
            exports.append(f"{family}/{kind}")
    torch.save({"ids": IDS, "exports": exports}, tmp_path / "request.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), OMP_NUM_THREADS="1")
    side = SIDE_SCRIPTS / "hf_families_side.py"
    proc = subprocess.run([str(python), str(side), str(tmp_path), str(tmp_path / "request.pt"),
                           str(tmp_path / "result.pt")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = torch.load(tmp_path / "result.pt")
    assert res["version"] == "4.57.6"
    for family in FAMILIES:
        assert res[f"{family}/std"]["class"] == FAMILIES[family][1]
        assert res[f"{family}/fbt"]["class"] == "FBTForCausalLM"
        for kind in ("fbt", "std"):
            assert rel(res[f"{family}/{kind}"]["logits"], refs[family]) < 1e-5, (family, kind)
