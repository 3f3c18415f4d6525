"""What users hit first with a Hugging Face export (issue 21): transformers versions across the supported
range, generate with and without the KV cache, the forward's documented passes, batched pipelines, the
stock tokenizer, beam search refused, scaled RoPE refused on import, atomic export with a progress bar,
and the --standard export's config.

The model: a stock transformers Llama (tied embeddings, RoPE base 500000, large init so greedy tokens
vary) imported with a fresh GLU fusion, so the feedback path is live, and exported with a sentencepiece
tokenizer. Its recipe's pass mix has 3 entries: forward_passes=3, prefill_passes=2 (they differ, so a
forward that ran the prefill's passes would show).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fbt_megatron.hf.mapping import ConversionError
from tests.support import SIDE_SCRIPTS, transformers_envs

SIDE = SIDE_SCRIPTS / "hf_versions_side.py"
VOCAB = 384
TEXTS = ["def add(a, b):\n\treturn a + b\n", "  two  spaces and 12345 digits"]


def _llama(path: Path, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=True,
               initializer_range=0.3, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    model = LlamaForCausalLM(LlamaConfig(**{**cfg, **overrides})).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """(run dir of the imported checkpoint, FBT export dir, sentencepiece model)."""
    from fbt_megatron import runtime
    from fbt_megatron.hf.export import export_checkpoint
    from fbt_megatron.hf.importer import import_hf
    from tests.integration.test_hf_convert import _sp_tokenizer

    root = tmp_path_factory.mktemp("first_use")
    _llama(root / "llama")
    sp = _sp_tokenizer(root / "tok" / "tokenizer.model")
    runtime.init_distributed()
    try:
        import_hf(root / "llama", root / "run", log=lambda *a: None)
        export_checkpoint(root / "run", root / "hf", tokenizer=sp, log=lambda *a: None)
    finally:
        runtime.shutdown()
    return root / "run", root / "hf", sp


def _request(tmp: Path) -> dict:
    g = torch.Generator().manual_seed(3)
    return {"ids": torch.randint(3, VOCAB - 64, (2, 12), generator=g),
            "prompt": torch.randint(3, VOCAB - 64, (1, 5), generator=g), "new_tokens": 6, "texts": TEXTS,
            "pipeline_prompts": ["def value", "class total count index result = 37", "x"]}


def run_side(python: str, export: Path, tmp: Path) -> dict:
    torch.save(_request(tmp), tmp / "request.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp / "hf_home"), OMP_NUM_THREADS="1")
    proc = subprocess.run([python, str(SIDE), str(export), str(tmp / "request.pt"), str(tmp / "result.pt")],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(tmp / "result.pt", weights_only=False)


def rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def check_side(res: dict, run: Path, sp: Path, version: str) -> None:
    """One transformers version's results against the documented behaviour."""
    from data_pipeline.tokenizer import load_tokenizer

    assert res["version"] == version and res["fbt_megatron_imported"] == []
    # The modelling file runs the export's feedback_rule.py (loaded beside it: a relative import of remote code),
    # which is the package's file byte for byte.
    rule = res["remote_rule"]
    assert rule["beside"] and rule["name"] == "feedback_rule.py", rule
    assert rule["bytes"] == (Path(__file__).resolve().parents[2] / "fbt_megatron/model/feedback_rule.py").read_bytes()
    assert {"fuse", "mix", "shifted_states", "stack_input", "stateless_input", "token_gate"} <= set(rule["shared"]), rule
    t = res["tokenizer"]
    assert t["class"] in ("PreTrainedTokenizerFast", "TokenizersBackend"), t  # stock, no remote code
    assert t["pad_token"] == "</s>" and t["pad_token_id"] == 2 and t["padding_side"] == "left", t
    assert t["model_max_length"] == 64, t  # the recipe's sequence length
    assert t["encodings"] == [load_tokenizer(sp).encode(x) for x in TEXTS]
    # docs/hf.md: 4.x loads the stock class without a question; 5.x reads config.json first, which names
    # the remote-code FBTConfig, and asks (a "no" loads the same tokenizer); trust_remote_code never asks.
    assert t["asked"] == {"plain": int(int(version.split(".")[0]) >= 5), "trusted": 0}, (version, t["asked"])
    assert t["trusted"] == {"class": t["class"], "encodings": t["encodings"], "pad_token": t["pad_token"],
                            "padding_side": "left"}, t["trusted"]
    # The forward runs forward_passes (3) whatever use_cache says: same logits and loss both ways.
    fwd = res["forward"]
    assert torch.equal(fwd[True]["logits"], fwd[False]["logits"]) and torch.equal(fwd[True]["loss"], fwd[False]["loss"])
    assert rel(fwd[True]["logits"], res["forward_passes"]) < 1e-6
    # Without the KV cache generate gives the cached path's tokens, in every decoding mode.
    gen = res["generate"]
    for mode in ("fused2", "exact", "standard"):
        assert torch.equal(gen[mode, True], gen[mode, False]), (version, mode, gen[mode, True], gen[mode, False])
    assert len(set(torch.cat([gen[m, True] for m in ("fused2", "exact", "standard")]).tolist())) > 2, gen
    assert "num_beams=2" in res["beams"] and "not supported" in res["beams"], res["beams"]
    # A batch of prompts of different lengths (left padded) gives each prompt's text alone.
    assert res["pipeline_batch"] == res["pipeline_alone"], res
    assert len(set(res["pipeline_alone"])) > 1, res["pipeline_alone"]


@pytest.fixture(scope="module")
def newest(export, tmp_path_factory):
    """The results under the running environment's transformers (the newest of the range)."""
    import transformers

    run, hf, sp = export
    res = run_side(sys.executable, hf, tmp_path_factory.mktemp("newest"))
    return res, transformers.__version__


def test_export_under_newest_transformers(export, newest, single_process):
    """The running transformers (newest of the supported range): tokenizer, forward, generate with and
    without the cache, beams refused, batched pipeline; the forward is the framework's 3-pass forward."""
    from fbt_megatron.hf.checkpoint_io import load_framework_model

    run, hf, sp = export
    res, version = newest
    check_side(res, run, sp, version)
    config = json.loads((hf / "config.json").read_text())
    assert (config["forward_passes"], config["prefill_passes"]) == (3, 2)
    model = load_framework_model(run)
    ids = _request(hf)["ids"]
    with torch.no_grad():
        ours = model(ids, num_passes=3).logits[..., :VOCAB]
        assert rel(res["forward"][True]["logits"], ours) < 1e-4
        assert rel(model(ids, num_passes=2).logits[..., :VOCAB], ours) > 1e-3  # 2 and 3 passes differ


def test_export_tokenizer_names_a_class_every_supported_transformers_has(export):
    """The export's tokenizer_config.json names PreTrainedTokenizerFast, which every transformers in the
    supported range has (transformers 5 saves its own TokenizersBackend, which 4.x lacks: a 4.x user's
    AutoTokenizer would fail on it) and no extra_special_tokens list (5.x's form of it), with left padding
    and the recipe's sequence length."""
    _, hf, _ = export
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast", cfg.get("tokenizer_class")
    assert not isinstance(cfg.get("extra_special_tokens"), list), cfg  # 5.x's list; 4.x reads a dict there
    assert cfg["padding_side"] == "left" and cfg["model_max_length"] == 64, cfg


def test_an_hf_tokenizer_with_its_sentencepiece_model_exports_both(export, tmp_path):
    """A run imported from a checkpoint whose tokenizer folder holds tokenizer.json and the sentencepiece
    tokenizer.model (Llama 2's layout; our own export's too) exports both files unchanged, and the same ids."""
    from transformers import PreTrainedTokenizerFast

    from fbt_megatron.hf.export import write_tokenizer

    _, hf, _ = export  # an export: tokenizer.json + tokenizer.model
    out = tmp_path / "out"
    out.mkdir()
    write_tokenizer(("hf", hf), out, VOCAB, max_length=64)
    for name in ("tokenizer.json", "tokenizer.model"):
        assert (out / name).read_bytes() == (hf / name).read_bytes(), name
    assert ([PreTrainedTokenizerFast.from_pretrained(str(out)).encode(t) for t in TEXTS] ==
            [PreTrainedTokenizerFast.from_pretrained(str(hf)).encode(t) for t in TEXTS])


def test_a_checkpoint_keeping_its_sentencepiece_model_exports_it(tmp_path):
    """A run's checkpoint keeps a copy of its sentencepiece model: the export takes that one."""
    from fbt_megatron.hf.export import tokenizer_source

    ckpt = tmp_path / "run" / "checkpoints" / "step_4"
    ckpt.mkdir(parents=True)
    (ckpt / "tokenizer.model").write_bytes(b"sp")
    assert tokenizer_source(ckpt, recipe=None) == ("sp", ckpt / "tokenizer.model")


def test_provenance_of_a_continued_import_adds_its_own_history(tmp_path):
    """A run continued from an import exports the source's history plus its own: steps and tokens added,
    pass counts added per pass count (a count the source never ran starts from 0), and the recipe it
    continued as named."""
    from types import SimpleNamespace

    from fbt_megatron.hf.export import provenance

    ckpt = tmp_path / "run" / "checkpoints" / "step_7"
    (tmp_path / "run" / "hf_import").mkdir(parents=True)
    source = {"recipe_name": "base", "steps": 100, "tokens_seen": 5000, "pass_counts": {"1": 60, "2": 40},
              "source_model_type": "llama"}
    (tmp_path / "run" / "hf_import" / "provenance.json").write_text(json.dumps(source))
    state = {"train_state": {"step": 7, "tokens_seen": 300, "pass_counts": {2: 4, 3: 3}}}
    got = provenance(ckpt, state, SimpleNamespace(name="continued"))
    assert got == dict(source, steps=107, tokens_seen=5300, pass_counts={"1": 60, "2": 44, "3": 3},
                       continued_as="continued"), got


@pytest.mark.parametrize("version", list(transformers_envs.VERSIONS))
def test_export_under_other_transformers(export, newest, version, tmp_path):
    """The same export under the oldest supported transformers (4.57), the first 5.x and 5.23 (the last
    that calls the cache `past_key_values`): everything works and gives the newest version's tokens and
    logits (the RoPE base reaches 4.x through rope_theta)."""
    try:
        python = transformers_envs.ensure(version)
    except transformers_envs.Unavailable as e:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):  # CI must test the whole range
            pytest.fail(f"transformers {version}: {e}")
        pytest.skip(str(e))
    run, hf, sp = export
    res = run_side(str(python), hf, tmp_path)
    check_side(res, run, sp, version)
    ref, _ = newest
    assert rel(res["forward"][True]["logits"], ref["forward"][True]["logits"]) < 1e-5
    for key, tokens in ref["generate"].items():
        assert torch.equal(res["generate"][key], tokens), key
    assert res["pipeline_batch"] == ref["pipeline_batch"]


def test_standard_export_config_and_tied_embeddings(export, tmp_path, single_process):
    """--standard of a tied-embedding recipe: config.json names rope_theta and torch_dtype (what
    transformers 4.x reads) and ties the embeddings; transformers' LlamaForCausalLM on it gives the FBT
    model's standard-mode (1-pass) logits."""
    from transformers import LlamaForCausalLM

    from fbt_megatron.hf.checkpoint_io import load_framework_model
    from fbt_megatron.hf.export import export_checkpoint

    run, _, _ = export
    export_checkpoint(run, tmp_path / "std", standard=True, dtype="fp32", log=lambda *a: None)
    config = json.loads((tmp_path / "std" / "config.json").read_text())
    assert config["rope_theta"] == 500000.0 and config["rope_parameters"]["rope_theta"] == 500000.0
    assert config["torch_dtype"] == "float32" and config["tie_word_embeddings"] is True
    assert config["use_cache"] is True  # transformers' generate reads it: False would decode without the KV cache
    # a plain Llama config: every field is one of transformers' LlamaConfig (or a 4.x name of one, above),
    # but the provenance (`fbt`); none of the fusion's or the FBT model's own
    from transformers import LlamaConfig

    foreign = set(config) - set(LlamaConfig().to_dict()) - {"architectures", "rope_theta", "torch_dtype"}
    assert foreign == {"fbt"}, foreign
    plain = LlamaForCausalLM.from_pretrained(tmp_path / "std").eval()
    assert plain.lm_head.weight.data_ptr() == plain.model.embed_tokens.weight.data_ptr()  # tied
    model = load_framework_model(run)
    assert "tie_embeddings: true" in (run / "recipe.yaml").read_text()
    ids = _request(tmp_path)["ids"]
    with torch.no_grad():
        assert rel(plain(ids).logits, model(ids, num_passes=1).logits[..., :VOCAB]) < 1e-5


def test_scaled_rope_on_import(tmp_path, single_process):
    """Llama 3's scaled RoPE (rope_type llama3), as transformers 4.x writes it (rope_scaling) or 5.x
    (rope_parameters), imports with its four parameters in the recipe; another scaling (yarn, linear) is
    refused naming the field and the type, and nothing is written."""
    import yaml

    from fbt_megatron.hf.importer import import_hf

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32, "rope_theta": 500000.0}
    _llama(tmp_path / "llama", rope_parameters=llama3)
    cfg_file = tmp_path / "llama" / "config.json"
    v5 = json.loads(cfg_file.read_text())
    assert v5["rope_parameters"]["rope_type"] == "llama3"
    scaling = {k: v for k, v in llama3.items() if k not in ("rope_type", "rope_theta")}
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}  # transformers 4.x's spelling
    v4.update(rope_theta=500000.0, rope_scaling={k: v for k, v in llama3.items() if k != "rope_theta"})
    for name, cfg in (("v5", v5), ("v4", v4)):
        cfg_file.write_text(json.dumps(cfg))
        import_hf(tmp_path / "llama", tmp_path / name, log=lambda *a: None)
        model = yaml.safe_load((tmp_path / name / "recipe.yaml").read_text())["model"]
        assert model["rope_scaling"] == scaling and model["rotary_base"] == 500000, name

    for key, cfg in (("rope_parameters", dict(v5, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                   "rope_theta": 500000.0})),
                     ("rope_scaling", dict(v4, rope_scaling={"rope_type": "linear", "factor": 2.0}))):
        cfg_file.write_text(json.dumps(cfg))
        kind = cfg[key]["rope_type"]
        with pytest.raises(ConversionError, match=rf"{key}.rope_type='{kind}'.*scaled RoPE"):
            import_hf(tmp_path / "llama", tmp_path / kind, log=lambda *a: None)
        assert not (tmp_path / kind).exists()


def test_tied_config_with_a_different_lm_head_is_refused_on_import(tmp_path, single_process):
    """config.json says tie_word_embeddings but the weights hold an lm_head that differs from the
    embedding: importing would keep the embedding as the head and drop the real one, so it is refused
    naming both tensors; nothing is written. With the head equal to the embedding it imports."""
    from safetensors.torch import load_file, save_file

    from fbt_megatron.hf.importer import import_hf

    _llama(tmp_path / "llama", tie_word_embeddings=False)
    cfg_file = tmp_path / "llama" / "config.json"
    cfg_file.write_text(json.dumps(dict(json.loads(cfg_file.read_text()), tie_word_embeddings=True)))
    weights = tmp_path / "llama" / "model.safetensors"
    tensors = load_file(weights)
    assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    with pytest.raises(ConversionError, match="tie_word_embeddings is set but lm_head.weight differs from "
                                              "model.embed_tokens.weight"):
        import_hf(tmp_path / "llama", tmp_path / "out", log=lambda *a: None)
    assert not (tmp_path / "out" / "checkpoints" / "latest").exists()

    save_file(dict(tensors, **{"lm_head.weight": tensors["model.embed_tokens.weight"].clone()}), weights,
              metadata={"format": "pt"})
    import_hf(tmp_path / "llama", tmp_path / "tied", log=lambda *a: None)
    assert (tmp_path / "tied" / "checkpoints" / "latest").exists()


def test_an_fbt_export_imports_with_its_own_fusion_and_schedule(export, tmp_path, single_process):
    """`fbt convert from-hf` of our own export: the written recipe keeps the export's fusion and its pass
    schedule (config.json's ``fbt`` provenance, kept in hf_import/); ``--fusion`` naming another fusion is
    refused, naming the export's, and nothing is written; ``--fusion`` naming the same one imports. The
    written recipe trains on from the imported checkpoint."""
    import yaml

    from fbt_megatron.hf.importer import import_hf

    run, hf, sp = export
    cfg = json.loads((hf / "config.json").read_text())
    fusion, prov = cfg["feedback_fusion"], cfg["fbt"]
    assert fusion == "glu" and len(prov["schedule"]["mix"]) == 3  # the fixture's fused, 3-entry mix
    import_hf(hf, tmp_path / "back", log=lambda *a: None)
    recipe = yaml.safe_load((tmp_path / "back" / "recipe.yaml").read_text())
    assert recipe["feedback"]["fusion"] == fusion
    assert recipe["schedule"] == prov["schedule"]
    assert json.loads((tmp_path / "back" / "hf_import" / "provenance.json").read_text()) == prov
    # the export's tokenizer is kept with it (what `fbt data prepare --tokenizer <out>/hf_import` reads)
    kept = sorted(p.name for p in (tmp_path / "back" / "hf_import").iterdir() if p.name != "provenance.json")
    assert "tokenizer.json" in kept and "tokenizer.model" in kept, kept
    assert all((tmp_path / "back" / "hf_import" / n).read_bytes() == (hf / n).read_bytes() for n in kept)

    # `fbt train <out>/recipe.yaml` continues from the imported checkpoint (step 0 -> 1)
    from tests.support.training import train_fn

    recipe["train"]["stop_at_step"] = 1
    recipe["logging"] = {"tensorboard": False}
    summary = train_fn(recipe)
    assert summary["step"] == 1 and len(summary["history"]) == 1, summary
    assert summary["checkpoint"].endswith("step_00000001")

    with pytest.raises(ConversionError, match=r"--fusion off: an FBT export keeps its own fusion \('glu'\)"):
        import_hf(hf, tmp_path / "off", fusion="off", log=lambda *a: None)
    assert not (tmp_path / "off").exists()
    import_hf(hf, tmp_path / "same", fusion="glu", log=lambda *a: None)
    assert yaml.safe_load((tmp_path / "same" / "recipe.yaml").read_text())["feedback"] == recipe["feedback"]


def test_a_sharded_stock_checkpoint_imports_like_a_single_file(tmp_path, single_process):
    """A stock checkpoint saved in shards (model.safetensors.index.json and its files, as large models
    come) imports to the same tensors as the same model saved in one file; a shard missing is named."""
    from fbt_megatron.checkpoint.manager import read_full_tensors
    from fbt_megatron.hf.importer import import_hf

    model = _llama(tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (tmp_path / "sharded" / "model.safetensors").exists()
    for name in ("one", "sharded"):
        import_hf(tmp_path / name, tmp_path / f"{name}_ckpt", fusion="off", log=lambda *a: None)
    one, sharded = read_full_tensors(tmp_path / "one_ckpt"), read_full_tensors(tmp_path / "sharded_ckpt")
    assert sorted(one) == sorted(sharded) and all(torch.equal(one[k], sharded[k]) for k in one)

    (tmp_path / "sharded" / shards[-1]).unlink()
    with pytest.raises(ConversionError, match=f"weight shard {shards[-1]} .* is missing"):
        import_hf(tmp_path / "sharded", tmp_path / "missing", fusion="off", log=lambda *a: None)


def test_bf16_export_writes_bf16_tensors(export, tmp_path, single_process):
    """`fbt convert to-hf --dtype bf16`: every tensor in the safetensors files is bfloat16 and is the fp32
    export's value rounded to bfloat16; config.json says bfloat16; transformers loads the --standard
    bf16 export as a bfloat16 model whose logits are the fp32 model's within bfloat16 precision."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from fbt_megatron.hf import cli

    run, fp32, _ = export
    assert cli.main(["to-hf", str(run), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    full = load_file(fp32 / "model.safetensors")
    half = load_file(tmp_path / "bf16" / "model.safetensors")
    assert set(half) == set(full)
    for name, t in half.items():
        assert t.dtype == torch.bfloat16, name
        assert torch.equal(t, full[name].to(torch.bfloat16)), name
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert (config["dtype"], config["torch_dtype"]) == ("bfloat16", "bfloat16")

    assert cli.main(["to-hf", str(run), str(tmp_path / "std16"), "--dtype", "bf16", "--standard"]) == 0
    assert cli.main(["to-hf", str(run), str(tmp_path / "std32"), "--standard"]) == 0
    assert {t.dtype for t in load_file(tmp_path / "std16" / "model.safetensors").values()} == {torch.bfloat16}
    m16 = LlamaForCausalLM.from_pretrained(tmp_path / "std16", dtype="auto").eval()
    m32 = LlamaForCausalLM.from_pretrained(tmp_path / "std32", dtype="auto").eval()
    assert m16.dtype == torch.bfloat16 and m32.dtype == torch.float32
    ids = _request(tmp_path)["ids"]
    with torch.no_grad():
        assert 1e-4 < rel(m16(ids).logits, m32(ids).logits) < 0.05


def test_export_forward_passes_is_the_deepest_trained_count(tmp_path):
    """config.forward_passes (what a plain forward runs) is the deepest pass count the recipe trains:
    a mix ending in 0 ([0.75, 0.25, 0.0]) never trained 3 passes, so its export forwards 2."""
    from fbt_megatron.hf.export import hf_config
    from fbt_megatron.recipe import load_recipe
    from tests.support.training import tiny_recipe

    for mix, deepest in [([0.75, 0.25, 0.0], 2), ([0.75, 0.22, 0.03], 3), ([1.0, 0.0, 0.0], 1)]:
        recipe = load_recipe(data=tiny_recipe(tmp_path, schedule={"mix": mix}))
        assert hf_config(recipe, {}, {}, "fp32")["forward_passes"] == deepest, mix
    off = load_recipe(data=tiny_recipe(tmp_path, feedback={"fusion": "off"}))
    assert hf_config(off, {}, {}, "fp32")["forward_passes"] == 1


def test_export_is_atomic_and_checks_inputs_first(export, tmp_path, single_process, monkeypatch, capsys):
    """`fbt convert to-hf` with a missing --tokenizer: a clear error before anything is written; a failure
    in the middle of writing the weights leaves no OUT_DIR (nor its temporary directory); an existing
    non-empty OUT_DIR is refused and kept as it was."""
    from fbt_megatron.hf import cli, export as export_mod

    run, _, _ = export
    target = tmp_path / "hf"
    assert cli.main(["to-hf", str(run), str(target), "--tokenizer", str(tmp_path / "missing.model")]) == 2
    err = capsys.readouterr().err
    assert "missing.model: tokenizer model not found" in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []

    calls = []

    def failing_save(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError(28, "No space left on device (injected)")
        from safetensors.torch import save_file

        save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr("safetensors.torch.save_file", failing_save)
    with pytest.raises(OSError, match="injected"):
        export_mod.export_checkpoint(run, target, max_shard_bytes=100_000, log=lambda *a: None)
    assert len(calls) == 2 and not target.exists() and list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())

    # a tokenizer the model cannot take (e.g. more tokens than vocab_size) fails before any weight is written
    def bad_tokenizer(*args, **kwargs):
        raise ConversionError("tokenizer has 999 tokens, more than the model's vocab_size (injected)")

    calls.clear()
    monkeypatch.setattr(export_mod, "write_tokenizer", bad_tokenizer)
    with pytest.raises(ConversionError, match="injected"):
        export_mod.export_checkpoint(run, target, max_shard_bytes=100_000, log=lambda *a: None)
    assert calls == [] and not target.exists() and list(tmp_path.iterdir()) == []
    monkeypatch.undo()

    target.mkdir()
    (target / "mine.txt").write_text("keep")
    with pytest.raises(ConversionError, match="already exists and is not an empty directory"):
        export_mod.export_checkpoint(run, target, log=lambda *a: None)
    assert [p.name for p in target.iterdir()] == ["mine.txt"]


def test_a_failed_export_reports_its_own_error_when_its_directory_is_gone(export, tmp_path, single_process,
                                                                         monkeypatch):
    """The clean-up after a failure does not replace the failure: an export whose temporary directory is
    already gone when it fails (removed from outside, e.g. by a user clearing a stuck export's
    `.OUT_DIR.partial-PID`) raises its own error, not the clean-up's, and leaves no OUT_DIR."""
    import shutil

    from fbt_megatron.hf import export as export_mod

    run, _, _ = export

    def write_then_fail(path, state, recipe, rows, reader, out, **kwargs):
        shutil.rmtree(out)
        raise ConversionError("the export's own failure (injected)")

    monkeypatch.setattr(export_mod, "_write_export", write_then_fail)
    with pytest.raises(ConversionError, match="own failure"):
        export_mod.export_checkpoint(run, tmp_path / "hf", log=lambda *a: None)
    assert list(tmp_path.iterdir()) == []


def test_a_sharded_export_names_its_shards_and_loads_with_transformers(export, tmp_path, single_process):
    """A max_shard_bytes below the model's size (the library called by keyword, into an OUT_DIR whose
    parent folders do not exist yet): the weights go to
    model-00001-of-0000N.safetensors ... model-0000N-of-0000N.safetensors (transformers' names, numbered
    from 1), each within the limit, with model.safetensors.index.json mapping every tensor to its file and
    giving the total size; the tensors are the single-file export's (which has no index). transformers
    loads a sharded --standard export through its index to the single-file export's weights."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from fbt_megatron.hf.export import export_checkpoint

    run, hf, _ = export
    single = load_file(hf / "model.safetensors")
    assert not (hf / "model.safetensors.index.json").exists()
    out = export_checkpoint(checkpoint=run, out_dir=tmp_path / "exports" / "v1" / "sharded", max_shard_bytes=100_000,
                            log=lambda *a: None)  # (folders that do not exist yet are made)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(files)
    assert n > 1 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)], files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    tensors = {}
    for name in files:
        part = load_file(out / name)
        assert {index["weight_map"][k] for k in part} == {name}, name
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 100_000 or len(part) == 1, name
        tensors.update(part)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert set(index["weight_map"]) == set(tensors) == set(single)
    assert all(torch.equal(tensors[k], single[k]) for k in single)

    # just over half the weights' bytes: exactly two shards, which need their index too
    two = export_checkpoint(run, tmp_path / "two", max_shard_bytes=int(0.6 * index["metadata"]["total_size"]),
                            log=lambda *a: None)
    index_two = json.loads((two / "model.safetensors.index.json").read_text())
    assert sorted(set(index_two["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                            "model-00002-of-00002.safetensors"]

    export_checkpoint(run, tmp_path / "std_sharded", standard=True, max_shard_bytes=100_000, log=lambda *a: None)
    export_checkpoint(run, tmp_path / "std_one", standard=True, log=lambda *a: None)
    assert (tmp_path / "std_sharded" / "model.safetensors.index.json").is_file()
    sharded = LlamaForCausalLM.from_pretrained(tmp_path / "std_sharded").state_dict()
    one = LlamaForCausalLM.from_pretrained(tmp_path / "std_one").state_dict()
    assert sharded.keys() == one.keys() and all(torch.equal(sharded[k], one[k]) for k in one)


def test_export_config_names_the_tokenizers_special_ids(export):
    """config.json and generation_config.json give the exported tokenizer's BOS, EOS and pad ids (its pad is
    its EOS: the sentencepiece model has no pad token), which generate reads to pad a batch and to stop;
    generate decodes greedily by default (do_sample false: the same tokens as `fbt generate`, run to run)
    and with the KV cache (use_cache true: false would recompute every prefix)."""
    from transformers import PreTrainedTokenizerFast

    _, hf, _ = export
    tok = PreTrainedTokenizerFast.from_pretrained(str(hf))
    want = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    assert None not in want.values() and want["pad_token_id"] == want["eos_token_id"], want
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((hf / name).read_text())
        assert {k: cfg[k] for k in want} == want, (name, cfg)
    assert json.loads((hf / "generation_config.json").read_text())["do_sample"] is False
    assert json.loads((hf / "config.json").read_text())["use_cache"] is True


def test_only_the_standard_export_needs_a_llama_class_recipe(export, tmp_path, single_process):
    """The same checkpoint under the `state` first-pass rule (pass 1 fuses h_init: its standard decoding is
    not a plain Llama): the FBT export writes it, with its rule in config.json; --standard refuses it by
    name before writing anything."""
    import shutil

    from fbt_megatron.hf.export import export_checkpoint

    run, _, _ = export
    ablation = tmp_path / "state_run"
    shutil.copytree(run, ablation, symlinks=True)
    for state_file in (ablation / "checkpoints").glob("step_*/state.json"):
        state = json.loads(state_file.read_text())
        state["recipe"]["feedback"]["first_input"] = "state"
        state_file.write_text(json.dumps(state))
    export_checkpoint(ablation, tmp_path / "fbt", log=lambda *a: None)
    assert json.loads((tmp_path / "fbt" / "config.json").read_text())["feedback_first_input"] == "state"
    with pytest.raises(ConversionError, match=r"not Llama-class: feedback.first_input='state'"):
        export_checkpoint(ablation, tmp_path / "std", standard=True, log=lambda *a: None)
    assert not (tmp_path / "std").exists()


def test_an_existing_empty_out_dir_is_used_and_a_file_there_refused(export, tmp_path, single_process):
    """OUT_DIR may exist if it is empty (a folder made for the export): the export fills it. A file in its
    place is refused, naming it, and kept."""
    from fbt_megatron.hf.export import export_checkpoint

    run, _, _ = export
    (tmp_path / "made").mkdir()
    export_checkpoint(run, tmp_path / "made", log=lambda *a: None)
    assert (tmp_path / "made" / "config.json").is_file() and (tmp_path / "made" / "model.safetensors").is_file()
    (tmp_path / "file").write_text("keep")
    with pytest.raises(ConversionError, match="file already exists and is not an empty directory"):
        export_checkpoint(run, tmp_path / "file", log=lambda *a: None)
    assert (tmp_path / "file").read_text() == "keep"


def test_to_hf_shows_progress_over_the_weight_bytes(export, tmp_path, single_process, capsys):
    """`fbt convert to-hf` writes a progress bar (stderr) that counts every weight byte written."""
    from safetensors import safe_open

    from fbt_megatron.hf.export import export_checkpoint

    run, _, _ = export
    export_checkpoint(run, tmp_path / "hf", max_shard_bytes=100_000, progress=True, log=lambda *a: None)
    total = 0
    for f in (tmp_path / "hf").glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            total += sum(st.get_tensor(k).numel() * st.get_tensor(k).element_size() for k in st.keys())
    from tqdm import tqdm

    err = capsys.readouterr().err
    size = tqdm.format_sizeof(total)
    assert "to-hf hf" in err and f"{size}/{size}" in err, (total, err[-500:])


def _on_a_terminal(argv: list[str], cwd: Path, env: dict, timeout_s: float = 300) -> tuple[int, str]:
    """Run ``argv`` with a pseudo-terminal as stdin/stdout/stderr (as a user at a shell does: transformers
    asks its remote-code question only where ``input()`` can be answered); returns (exit code, output)."""
    import pty
    import select
    import time

    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    poller = select.poll()
    poller.register(master, select.POLLIN)
    out, deadline = b"", time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if poller.poll(1000):  # poll, not select: select() refuses descriptors >= 1024
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every holder of the terminal's other end has closed it
                    break
                if not chunk:
                    break
                out += chunk
        else:
            proc.kill()
    finally:
        os.close(master)
    return proc.wait(), out.decode(errors="replace")


def test_model_card_code_runs_on_a_terminal_without_a_question(export, tmp_path):
    """The export's README.md code, run from the export folder on a terminal: it loads, generates and
    prints without transformers asking "Do you wish to run the custom code?" (transformers 5's
    AutoTokenizer reads config.json, which names the remote-code config, so the card passes
    trust_remote_code to the tokenizer as to the model)."""
    _, hf, _ = export
    card = (hf / "README.md").read_text()
    code = card.split("```python\n", 1)[1].split("```", 1)[0]
    assert 'path = "."' in code and "AutoTokenizer.from_pretrained(path" in code, code
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), OMP_NUM_THREADS="1")
    rc, out = _on_a_terminal([sys.executable, "-c", code], cwd=hf, env=env)
    assert "custom code" not in out and "trust_remote_code" not in out, out[-3000:]
    assert rc == 0, out[-3000:]
