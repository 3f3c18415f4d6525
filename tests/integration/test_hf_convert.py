"""Hugging Face conversion: parity of an export with the framework, round trip, stock Llama import,
bad checkpoints.

The checkpoints are trained and saved at TP=2 or PP=2 (2 gloo processes); the framework reference loads them at
TP=1 in this process; the HF side runs in a fresh process with HF_HUB_OFFLINE=1 (tests/support/side/hf_side.py), so
the export must be self-contained (transformers + the shipped modelling file).
"""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fbt_megatron.hf.mapping import ConversionError
from tests.support import SIDE_SCRIPTS
from tests.support.distributed import run_distributed
from tests.support.training import tiny_recipe

HF_SIDE = SIDE_SCRIPTS / "hf_side.py"
RTOL = 1e-4
PASSES = (1, 2, 3)
VOCAB = 384
TEXTS = ["def add(a, b):\n\treturn a + b\n", "  two  spaces and 12345 digits", "x = 'mixed' + \"quotes\"\n"]

# Two architectures, both trained at TP=2 for a few steps (feedback from step 1):
# the default GPT block (rope, tied embeddings, LayerNorm, biases) and learned positions with untied
# embeddings, RMSNorm, fusion biases and the bounded mixin. init_method_std is large so that greedy tokens vary (0.2 gave
# one repeated token for the learned variant with the layout-independent init, and for the rope variant
# once pass 1 became the plain model: 0.4 varies).
VARIANTS = {
    "rope": {"model": {"vocab_size": VOCAB, "init_method_std": 0.4}, "feedback": {}},
    "learned": {"model": {"vocab_size": VOCAB, "init_method_std": 0.5, "position_embedding_type": "learned_absolute",
                          "tie_embeddings": False, "normalization": "RMSNorm"},
                # the bounded mixin with W_U at 3 x I: its spectral clamp is active, so the export must
                # write W_U / sigma_max as the trained model applies it
                "feedback": {"bias": True, "prefix_mixin": 0.3, "mixin": "bounded", "value_init_scale": 3.0}},
}
# The rope variant again, trained and saved at PP=2 (two pipeline stages, the tied embedding on both).
VARIANTS["rope_pp2"] = {**VARIANTS["rope"], "parallel": {"tensor": 1, "pipeline": 2}}
# The Llama-class options (SwiGLU, GQA, no bias, RoPE base, padding).
VARIANTS["llama"] = {"model": {"vocab_size": VOCAB - 50, "init_method_std": 0.2, "activation": "swiglu",
                               "normalization": "RMSNorm", "num_query_groups": 2, "add_bias_linear": False,
                               "tie_embeddings": False, "rotary_base": 500000, "ffn_hidden_size": 96},
                     "feedback": {}}


def _recipe(run_dir, variant):
    v = VARIANTS[variant]
    return tiny_recipe(run_dir, parallel={"tensor": 2, "zero_stage": 0, **v.get("parallel", {})}, train={"steps": 3},
                       schedule={"feedback_start_step": 1, "mix": [0.2, 0.5, 0.3], "seed": 3},
                       checkpoint={"every": 1000, "at_end": True}, model=dict(v["model"]),
                       feedback={"jitter_std": 0.02, **v["feedback"]})


def _sp_tokenizer(path: Path) -> Path:
    from data_pipeline.tokenizer import train_tokenizer

    words = "def return class import print value total count index result lambda while for in if else".split()
    texts = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) + f" = {i * 37}\n\tx" for i in range(300)]
    train_tokenizer(texts, path, vocab_size=VOCAB - 64, num_threads=1)
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{variant: (checkpoint dir, export dir)}, plus the sentencepiece model used by the rope export."""
    from fbt_megatron.hf.export import export_checkpoint
    from tests.support.hf import train_recipes

    root = tmp_path_factory.mktemp("hf")
    run_distributed(train_recipes, 2, [_recipe(root / f"run_{v}", v) for v in VARIANTS])
    sp = _sp_tokenizer(root / "tok" / "tokenizer.model")
    out = {}
    for v in VARIANTS:
        # A small shard size forces several safetensors files and the index.
        export_checkpoint(root / f"run_{v}", root / f"hf_{v}", max_shard_bytes=200_000,
                          tokenizer=sp if v == "rope" else None, log=lambda *a: None)
        out[v] = (root / f"run_{v}", root / f"hf_{v}")
    out["sp"] = sp
    return out


def test_every_exported_file_has_the_mode_config_json_has(exported):
    """Others on a cluster serve an export: its weights are as readable as its config.json (safetensors >= 0.8
    writes its files 0600 whatever the umask, safetensors#782), sharded exports included."""
    for variant in VARIANTS:
        _, export = exported[variant]
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in export.iterdir() if p.is_file()}
        assert any(name.endswith(".safetensors") for name in modes)
        assert set(modes.values()) == {modes["config.json"]}, (variant, {n: oct(m) for n, m in modes.items()})


def run_hf_side(export: Path, request: dict, tmp: Path) -> dict:
    """tests/support/side/hf_side.py in a fresh process: offline, its own HF cache, no fbt_megatron on the path."""
    torch.save(request, tmp / "request.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp / "hf_home"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(HF_SIDE), str(export), str(tmp / "request.pt"), str(tmp / "result.pt")],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(tmp / "result.pt")


def rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_matches_framework(exported, variant, tmp_path, single_process):
    """HF logits == framework logits for 1, 2, 3 passes; greedy generation gives the framework's tokens
    in feedback and standard decoding (and their logits); FUSED prefill with K = prompt length is exact."""
    from fbt_megatron.hf.checkpoint_io import load_framework_model
    from fbt_megatron.model.sequential import sequential_forward

    run, export = exported[variant]
    saved = json.loads(next(run.glob("checkpoints/step_*/state.json")).read_text())["layout"]
    assert (saved["tensor"], saved["pipeline"]) == ((1, 2) if variant.endswith("pp2") else (2, 1)), saved
    files = sorted(p.name for p in export.iterdir())
    assert "model.safetensors.index.json" in files and "modeling_fbt.py" in files and "README.md" in files
    # the remote code as the package holds it: the modelling file and the feedback rule it imports
    import fbt_megatron.model

    package = Path(fbt_megatron.model.__file__).parent
    for name in ("modeling_fbt.py", "feedback_rule.py"):
        assert (export / name).read_bytes() == (package / name).read_bytes(), name
    g = torch.Generator().manual_seed(1)
    vocab = VARIANTS[variant]["model"]["vocab_size"]
    ids = torch.randint(0, vocab, (2, 11), generator=g)
    prompt = torch.randint(0, vocab, (1, 4), generator=g)
    request = {"ids": ids, "passes": PASSES, "prompt": prompt, "new_tokens": 6,
               "texts": TEXTS if variant == "rope" else None}
    hf = run_hf_side(export, request, tmp_path)
    assert hf["class"] == "FBTForCausalLM" and hf["fbt_megatron_imported"] == []
    assert all(not v for k, v in hf["loading_info"].items() if k in ("missing_keys", "unexpected_keys",
                                                                       "mismatched_keys")), hf["loading_info"]

    model = load_framework_model(run)
    with torch.no_grad():
        for k in PASSES:
            ours = model(ids, num_passes=k).logits[..., :vocab]  # (padded vocabulary columns are -inf)
            assert rel(hf["logits"][k], ours) < RTOL, f"{k} passes: rel diff {rel(hf['logits'][k], ours):.2e}"
        # Passes differ from each other (else the multi-pass comparison would prove nothing).
        assert rel(hf["logits"][1], hf["logits"][3]) > 1e-3

        gen = hf["generate"]
        p = prompt.shape[1]
        for mode, reference in (("feedback", lambda s: sequential_forward(model, s).logits[..., :vocab]),
                                ("standard", lambda s: model(s, num_passes=1).logits[..., :vocab])):
            seq = gen[mode]["tokens"]
            ref = reference(seq)  # the framework's logits along HF's sequence
            # Greedy under the framework at every step == HF's next token (so the framework's own greedy
            # loop, token by token, produces exactly this sequence).
            assert torch.equal(ref[0, p - 1:-1].argmax(-1), seq[0, p:]), (mode, seq)
            assert rel(gen[mode]["logits"][0], ref[0, p - 1:-1]) < RTOL, mode
        generated = torch.cat([gen[m]["tokens"][0, p:] for m in ("feedback", "standard")])
        assert len(set(generated.tolist())) > 1, f"degenerate greedy outputs {generated.tolist()}"
        assert torch.equal(gen["fused_full"]["tokens"], gen["feedback"]["tokens"])
        padded = hf["padded_batch"]
        assert torch.equal(padded[0], gen["feedback"]["tokens"][0])
        assert torch.equal(padded[1, p:], hf["short_alone"][0, 2:])
        # FUSED prefill (2 passes): the first generated token's logits are the framework's 2-pass logits.
        assert rel(gen["fused2"]["logits"][0, 0], model(prompt, num_passes=2).logits[0, -1, :vocab]) < RTOL

    # The framework's own KV-cache decoder (`fbt generate`) gives HF's tokens and logits in every mode,
    # and the left-padded batch.
    from fbt_megatron.generate.decoder import FeedbackDecoder
    from fbt_megatron.generate.loading import load_for_inference
    from fbt_megatron.generate.sampling import SamplingParams

    loaded = load_for_inference(run, need_tokenizer=False)
    greedy = SamplingParams(max_new_tokens=request["new_tokens"])
    for mode, decoder in (("feedback", FeedbackDecoder(loaded.model, "feedback", "exact")),
                          ("standard", FeedbackDecoder(loaded.model, "standard", 1)),
                          ("fused2", FeedbackDecoder(loaded.model, "feedback", 2))):
        out = decoder.generate([prompt[0].tolist()], greedy, return_logits=True)
        assert out.tokens[0] == gen[mode]["tokens"][0, p:].tolist(), mode
        assert rel(gen[mode]["logits"][0], out.logits[0]) < RTOL, mode
    batch = FeedbackDecoder(loaded.model, "feedback", "exact").generate(
        [prompt[0].tolist(), prompt[0, -2:].tolist()], greedy, padding="left")
    assert batch.tokens == [padded[0, p:].tolist(), padded[1, p:].tolist()]

    if variant == "rope":  # the exported tokenizer encodes like the run's sentencepiece model
        from data_pipeline.tokenizer import load_tokenizer

        sp = load_tokenizer(exported["sp"])
        assert hf["encodings"] == [sp.encode(t) for t in TEXTS]
        assert hf["decodings"] == TEXTS
    card = (export / "README.md").read_text()
    config = json.loads((export / "config.json").read_text())
    assert config["fbt"]["steps"] == 3 and str(config["fbt"]["tokens_seen"]) in card.replace(",", "")


def test_export_import_export_is_bit_identical(exported, tmp_path, single_process):
    """Round trip: the imported checkpoint holds the original weights (loaded at TP=1 from a TP=2
    save) and exports to the same bytes, file by file."""
    from fbt_megatron.hf.checkpoint_io import load_framework_model
    from fbt_megatron.hf.export import export_checkpoint
    from fbt_megatron.hf.importer import import_hf

    run, export = exported["rope"]
    import_hf(export, tmp_path / "imported", log=lambda *a: None)
    export_checkpoint(tmp_path / "imported", tmp_path / "again", max_shard_bytes=200_000, log=lambda *a: None)
    names = sorted(p.name for p in export.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "again").iterdir())
    for name in names:
        assert (export / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name

    original = dict(load_framework_model(run).named_parameters())
    for name, p in load_framework_model(tmp_path / "imported").named_parameters():
        assert torch.equal(p, original[name]), name
    # The imported checkpoint is trainable in another layout: its own recipe resumes it at TP=2.
    import yaml

    from tests.support.training import train_fn

    recipe = yaml.safe_load((tmp_path / "imported" / "recipe.yaml").read_text())
    recipe["parallel"]["tensor"] = 2
    recipe["train"]["stop_at_step"] = 1
    recipe["logging"] = {"tensorboard": False}
    summary = run_distributed(train_fn, 2, recipe)[0]
    assert summary["step"] == 1 and summary["checkpoint"].endswith("step_00000001")
    # Its export carries the whole history: the source's steps and pass counts plus the step trained since.
    from fbt_megatron.config import PassScheduleConfig
    from fbt_megatron.passes import PassSchedule

    export_checkpoint(tmp_path / "imported", tmp_path / "continued", log=lambda *a: None)
    source = json.loads((export / "config.json").read_text())["fbt"]
    k = PassSchedule(PassScheduleConfig(**recipe["schedule"])).num_passes(0)
    assert source["steps"] == 3 and source["pass_counts"].get(str(k), 0) > 0, (source, k)  # k adds to a count
    want = dict(source["pass_counts"])
    want[str(k)] += 1
    got = json.loads((tmp_path / "continued" / "config.json").read_text())["fbt"]
    assert (got["steps"], got["pass_counts"], got["recipe_name"]) == (4, want, source["recipe_name"])


def _stock_llama(path: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rms_norm_eps=1e-5, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def test_stock_llama_import(tmp_path, single_process):
    """A LlamaForCausalLM saved by transformers imports: the FBT model's first pass IS the stock model
    (fp32, <= 1e-5 relative), with a fresh fusion and a feedback-phase recipe, and its --standard export
    is the stock model again; with the fusion off the same holds."""
    from transformers import LlamaForCausalLM

    from fbt_megatron.hf.checkpoint_io import load_framework_model
    from fbt_megatron.hf.export import export_checkpoint
    from fbt_megatron.hf.importer import import_hf

    llama = _stock_llama(tmp_path / "llama")
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = llama(ids).logits
    import_hf(tmp_path / "llama", tmp_path / "plain", fusion="off", log=lambda *a: None)
    with torch.no_grad():
        assert rel(load_framework_model(tmp_path / "plain")(ids).logits, theirs) < 1e-5

    import_hf(tmp_path / "llama", tmp_path / "fbt", log=lambda *a: None)
    model = load_framework_model(tmp_path / "fbt")
    assert model.feedback is not None and model.feedback_config.first_input == "embedding"
    with torch.no_grad():
        assert rel(model(ids, num_passes=1).logits[..., :256], theirs) < 1e-5  # the stock model's behaviour
        assert rel(model(ids, num_passes=2).logits[..., :256], theirs) > 1e-3  # the fresh fusion is live
    recipe = (tmp_path / "fbt" / "recipe.yaml").read_text()
    assert "feedback_start_step: 0" in recipe and "dedicated feedback phase" in recipe

    export_checkpoint(tmp_path / "fbt", tmp_path / "back", standard=True, log=lambda *a: None)
    assert not (tmp_path / "back" / "modeling_fbt.py").exists()
    back = LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert rel(back(ids).logits, theirs) < 1e-6


def test_the_imported_recipe_never_trains_a_random_model(tmp_path, single_process, monkeypatch, capsys):
    """The recipe from-hf writes resumes its import where its run_dir (relative, as the guide gives it) finds
    the checkpoint; from another directory, or with another run_dir, it finds none and is refused in one
    sentence (checkpoint.resume: required) instead of training a freshly initialised model."""
    import yaml

    from fbt_megatron.cli import main
    from fbt_megatron.hf.importer import import_hf

    _stock_llama(tmp_path / "llama")
    monkeypatch.chdir(tmp_path)
    checkpoint = import_hf(Path("llama"), Path("runs/llama-fbt"), log=lambda *a: None)
    recipe = str(tmp_path / "runs/llama-fbt/recipe.yaml")

    capsys.readouterr()
    assert main(["train", recipe, "--dry-run"]) == 0
    resumed = yaml.safe_load(capsys.readouterr().out)["resolved"]
    assert resumed["resume"]["checkpoint"] == str(checkpoint) and resumed["steps"]["resumed_at"] == 0

    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["train", recipe]) == 2  # a real run, refused before it writes anything
    assert capsys.readouterr().err.strip().endswith(
        f"the recipe continues a checkpoint, but runs/llama-fbt does not exist in {tmp_path / 'elsewhere'}: run it "
        "from the directory that holds runs/llama-fbt, or set run_dir to its full path; for a new run from a "
        "checkpoint's weights, add init_from=CHECKPOINT checkpoint.resume=true")
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == []
    assert main(["train", recipe, f"run_dir={tmp_path / 'runs/llama-fbt'}", "--dry-run"]) == 0
    capsys.readouterr()
    # a new run from the import, as the refusal and the guide say
    assert main(["train", recipe, "run_dir=variant", f"init_from={checkpoint.resolve()}", "checkpoint.resume=true",
                 "--dry-run"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["resolved"]["resume"]["init_from"] == str(checkpoint.resolve())


def test_standard_export_is_transformers_llama(exported, tmp_path, single_process):
    """`fbt convert to-hf --standard` of a trained Llama-class FBT checkpoint: transformers' own
    LlamaForCausalLM (no remote code) gives the FBT model's standard decoding: 1-pass logits and the
    framework decoder's greedy tokens; a recipe that is not Llama-class is refused by name."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from fbt_megatron.generate.decoder import FeedbackDecoder
    from fbt_megatron.generate.sampling import SamplingParams
    from fbt_megatron.hf.checkpoint_io import load_framework_model
    from fbt_megatron.hf.export import export_checkpoint

    run, _ = exported["llama"]
    export_checkpoint(run, tmp_path / "std", standard=True, log=lambda *a: None)
    config = json.loads((tmp_path / "std" / "config.json").read_text())
    assert config["model_type"] == "llama" and "auto_map" not in config
    assert not any(k.startswith("feedback") for k in config)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "std").eval()  # no trust_remote_code
    assert type(plain) is LlamaForCausalLM
    model = load_framework_model(run)
    vocab = VARIANTS["llama"]["model"]["vocab_size"]
    ids = torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids, num_passes=1).logits[..., :vocab]
        assert rel(plain(ids).logits, ours) < 1e-5
        prompt = ids[:1, :4]
        theirs = plain.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, 4:].tolist()
    assert FeedbackDecoder(model, "standard", 1).generate([prompt[0].tolist()],
                                                          SamplingParams(max_new_tokens=6)).tokens[0] == theirs

    with pytest.raises(ConversionError, match=r"not Llama-class: model.activation='gelu' .*"
                                              r"model.normalization='LayerNorm'"):
        export_checkpoint(exported["rope"][0], tmp_path / "gpt_std", standard=True, log=lambda *a: None)
    assert not (tmp_path / "gpt_std").exists()


def test_bad_checkpoints_fail_clearly(exported, tmp_path):
    """A missing or truncated shard, or a tensor whose shape contradicts the recipe, is refused with an
    error naming the file or key and the expected value."""
    from fbt_megatron.hf.export import export_checkpoint

    run, _ = exported["rope"]
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()

    def broken(name):
        ckpt = tmp_path / name / "checkpoints" / latest.name
        shutil.copytree(latest, ckpt)
        (ckpt.parent / "latest").write_text(latest.name + "\n")
        return ckpt

    missing = broken("missing")
    shard = sorted((missing / "weights").glob("*.distcp"))[-1]
    shard.unlink()
    with pytest.raises(ConversionError, match=f"shard .*{shard.name} is missing"):
        export_checkpoint(missing, tmp_path / "out1", log=lambda *a: None)

    truncated = broken("truncated")
    shard = sorted((truncated / "weights").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ConversionError, match=f"{shard.name} is truncated"):
        export_checkpoint(truncated, tmp_path / "out2", log=lambda *a: None)

    mismatched = broken("mismatched")
    state = json.loads((mismatched / "state.json").read_text())
    state["recipe"]["model"]["ffn_hidden_size"] = 128  # the checkpoint holds 4 * 64 = 256
    (mismatched / "state.json").write_text(json.dumps(state))
    with pytest.raises(ConversionError, match=r"linear_fc1.weight' has shape \(2, 256, 64\).*expects \(2, 128, 64\)"):
        export_checkpoint(mismatched, tmp_path / "out3", log=lambda *a: None)
    assert not (tmp_path / "out1" / "config.json").exists()


def test_bounded_mixin_travels_through_export_and_import(exported):
    """The learned variant trains with the bounded mixin: its export names it (W_U written as applied)
    and the import's recipe trains with it again, so a continued run keeps the bound."""
    from fbt_megatron.hf.mapping import recipe_sections

    config = json.loads((exported["learned"][1] / "config.json").read_text())
    assert config["feedback_mixin"] == "bounded"
    _, feedback_section = recipe_sections(config)
    assert feedback_section["mixin"] == "bounded"
    assert recipe_sections(json.loads((exported["rope"][1] / "config.json").read_text()))[1]["mixin"] == "affine"
