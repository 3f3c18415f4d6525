"""`fbt convert to-hf`'s pieces that need no trained checkpoint (fbt_megatron/hf/export.py), each against
what the export promises: shards filled up to ``max_shard_bytes`` in reading order, the provenance of a
checkpoint that records no training, the tokenizer a run's recipe names, an HF tokenizer folder without a
sentencepiece model and the special token ids it gives the config, and the bounded mixin's W_U written
inside the unit ball so that an import applies the bound again without a change. The whole export, loaded
by transformers: tests/integration/test_hf_first_use.py."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch

from fbt_megatron.hf import export
from fbt_megatron.hf.mapping import ConversionError

VOCAB = 300
TEXTS = ["def add(a, b):\n\treturn a + b\n", "  two  spaces and 12345 digits", "x = 'mixed' + \"quotes\"\n"]


# ---------------------------------------------------------------------- shards
def _check_shards(entries: list[tuple[str, int]], limit: int) -> list[list[str]]:
    """The shard plan of ``entries`` against its definition: the tensors in reading order, a shard written
    as soon as the next tensor would take it past ``limit`` (never sooner), and none over ``limit`` unless
    it holds one tensor that is larger by itself."""
    shards = export.plan_shards(entries, limit)
    size = dict(entries)
    assert [n for shard in shards for n in shard] == [n for n, _ in entries]
    assert all(shards)
    for shard in shards:
        assert sum(size[n] for n in shard) <= limit or len(shard) == 1, (shard, limit)
    for shard, following in zip(shards, shards[1:]):
        assert sum(size[n] for n in shard) + size[following[0]] > limit, (shard, following[0], limit)
    return shards


def test_shards_fill_up_to_the_limit_in_reading_order():
    entries = [("a", 60), ("b", 40), ("c", 50), ("d", 50), ("e", 100), ("f", 30), ("g", 200), ("h", 10)]
    # each of the first two shards exactly full (100 of 100 bytes); a tensor larger than the limit alone
    assert _check_shards(entries, 100) == [["a", "b"], ["c", "d"], ["e"], ["f"], ["g"], ["h"]]
    assert _check_shards(entries, 10**9) == [[n for n, _ in entries]]  # all in one: model.safetensors
    # a second shard that would be one byte over the limit: closed before its last tensor
    assert _check_shards([("a", 60), ("b", 50), ("c", 51)], 100) == [["a"], ["b"], ["c"]]
    rng = random.Random(0)
    for _ in range(300):  # any byte counts (a bias of an odd width in bf16), any limit
        sizes = [(f"t{i}", rng.randint(1, 150)) for i in range(rng.randint(1, 30))]
        _check_shards(sizes, rng.randint(20, 400))


# ---------------------------------------------------------------------- provenance
def test_provenance_of_a_checkpoint_that_records_no_training(tmp_path):
    """A checkpoint whose state records no training counters (no train_state) has trained 0 steps on 0
    tokens; continued from an import, it adds nothing to the source's history and names no continuation."""
    from fbt_megatron.recipe import load_recipe
    from tests.support.training import tiny_recipe

    recipe = load_recipe(data=tiny_recipe(tmp_path / "run", name="fresh"))
    ckpt = tmp_path / "run" / "checkpoints" / "step_0"
    got = export.provenance(ckpt, {}, recipe)
    assert (got["recipe_name"], got["steps"], got["tokens_seen"], got["pass_counts"]) == ("fresh", 0, 0, {}), got
    assert got["seq_length"] == recipe.data.seq_length

    (tmp_path / "run" / "hf_import").mkdir(parents=True)
    source = {"recipe_name": "base", "steps": 100, "tokens_seen": 5000, "pass_counts": {"1": 60, "2": 40}}
    (tmp_path / "run" / "hf_import" / "provenance.json").write_text(json.dumps(source))
    assert export.provenance(ckpt, {}, recipe) == source


def test_provenance_of_a_run_continued_from_an_import_that_recorded_no_history(tmp_path):
    """`from-hf` of an FBT export whose config.json has no `fbt` section writes an empty provenance.json:
    the source's history is then nothing, and the continued run exports its own steps, tokens and pass
    counts (and the recipe it continued as)."""
    from types import SimpleNamespace as NS

    ckpt = tmp_path / "run" / "checkpoints" / "step_7"
    (tmp_path / "run" / "hf_import").mkdir(parents=True)
    (tmp_path / "run" / "hf_import" / "provenance.json").write_text("{}")
    state = {"train_state": {"step": 7, "tokens_seen": 300, "pass_counts": {1: 5, 2: 2}}}
    assert export.provenance(ckpt, state, NS(name="continued")) == {
        "steps": 7, "tokens_seen": 300, "pass_counts": {"1": 5, "2": 2}, "continued_as": "continued"}


# ---------------------------------------------------------------------- tokenizer
def test_a_pipeline_run_exports_the_tokenizer_its_recipe_names(tmp_path):
    """A checkpoint without a copy of its tokenizer (saved before checkpoints kept one): a run on the data
    pipeline exports the tokenizer its recipe names (data.pipeline.tokenizer), and a missing one is named;
    a run on synthetic tokens has no tokenizer, whatever pipeline section its recipe keeps."""
    from fbt_megatron.recipe import DataSection

    ckpt = tmp_path / "run" / "checkpoints" / "step_4"
    ckpt.mkdir(parents=True)
    sp = tmp_path / "tok" / "tokenizer.model"
    sp.parent.mkdir()
    sp.write_bytes(b"sp")
    pipeline = SimpleNamespace(data=DataSection(source="pipeline", pipeline={"tokenizer": str(sp)}))
    assert export.tokenizer_source(ckpt, pipeline) == ("sp", sp)
    synthetic = SimpleNamespace(data=DataSection(source="synthetic", pipeline={"tokenizer": str(sp)}))
    assert export.tokenizer_source(ckpt, synthetic) is None
    sp.unlink()
    with pytest.raises(ConversionError, match=rf"^the run's tokenizer {sp} \(its recipe's data.pipeline.tokenizer\) "
                                              r"was not found in .* or the checkpoint's parent directories: pass "
                                              r"--tokenizer PATH$"):
        export.tokenizer_source(ckpt, pipeline)


def test_an_hf_tokenizer_without_a_sentencepiece_model_exports_and_names_its_special_ids(tmp_path):
    """A Hugging Face tokenizer folder with tokenizer.json and its config only (a byte-level BPE, Llama 3's
    layout: no tokenizer.model) exports those files unchanged and no tokenizer.model; the ids it gives the
    config are its BOS and EOS, and as pad (it has none of its own) its EOS, which the exported
    tokenizer pads with."""
    from transformers import PreTrainedTokenizerFast

    from tests.support.data_fixtures import train_hf_bpe

    src = train_hf_bpe([t * (1 + i % 3) for i, t in enumerate(TEXTS * 8)], tmp_path / "bpe", vocab_size=VOCAB)
    out = tmp_path / "out"
    out.mkdir()
    ids = export.write_tokenizer(("hf", src), out, VOCAB, max_length=64)
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert not (out / "tokenizer.model").exists()
    vocab = json.loads((src / "tokenizer.json").read_text())["model"]["vocab"]
    bos, eos = vocab["<|begin_of_text|>"], vocab["<|end_of_text|>"]
    assert ids == {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos}, ids
    tok = PreTrainedTokenizerFast.from_pretrained(str(out))
    assert (tok.pad_token, tok.pad_token_id, tok.padding_side) == ("<|end_of_text|>", eos, "left")
    # no vocabulary size to check against (None): the same export
    unchecked = tmp_path / "unchecked"
    unchecked.mkdir()
    assert export.write_tokenizer(("hf", src), unchecked, None, max_length=64) == ids


def test_a_tokenizer_saved_by_transformers_5_keeps_its_added_special_tokens(tmp_path):
    """A tokenizer with added special tokens (a chat template's <|im_start|>, <|im_end|>) saved by
    transformers 5 lists them under `extra_special_tokens`, a list where 4.x expects a dict: the export
    names them `additional_special_tokens` (4.x's key) instead, and the exported tokenizer treats them as
    special (decoding with skip_special_tokens drops them); the save's machine-local flags are dropped."""
    from transformers import PreTrainedTokenizerFast

    from tests.support.data_fixtures import train_hf_bpe

    src = train_hf_bpe([t * (1 + i % 3) for i, t in enumerate(TEXTS * 8)], tmp_path / "bpe", vocab_size=VOCAB)
    tok = PreTrainedTokenizerFast.from_pretrained(str(src))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.save_pretrained(str(tmp_path / "chat"))
    out = tmp_path / "out"
    out.mkdir()
    export.write_tokenizer(("hf", tmp_path / "chat"), out, VOCAB + 2, max_length=64)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["additional_special_tokens"] == ["<|im_start|>", "<|im_end|>"], cfg
    assert "extra_special_tokens" not in cfg, cfg
    # the flags transformers 5 records about this machine's copy (is_local: true, ...) stay behind: an
    # export is meant to be loaded elsewhere, from the Hub too
    written = json.loads((tmp_path / "chat" / "tokenizer_config.json").read_text())
    local = {"is_local", "local_files_only", "backend"}
    assert local & set(written) and not local & set(cfg), (set(written), set(cfg))
    exported = PreTrainedTokenizerFast.from_pretrained(str(out))
    ids = exported.encode("<|im_start|>def add<|im_end|>")
    assert exported.decode(ids, skip_special_tokens=True) == "def add", exported.decode(ids)


def test_a_bare_tokenizer_json_exports_the_eos_the_run_ended_documents_with(tmp_path):
    """A Hugging Face tokenizer.json alone (no tokenizer_config.json: it names no EOS): the export names
    the data pipeline's EOS, the token the run was trained to end documents with, as the tokenizer's EOS
    (generation stops on it) and pads with it."""
    from transformers import PreTrainedTokenizerFast

    from data_pipeline.tokenizer import load_tokenizer
    from tests.support.data_fixtures import train_hf_bpe

    src = train_hf_bpe([t * (1 + i % 3) for i, t in enumerate(TEXTS * 8)], tmp_path / "bare", vocab_size=VOCAB,
                       config=False)
    assert not (src / "tokenizer_config.json").exists()
    pipeline = load_tokenizer(src)
    eos = pipeline.eos_id()
    out = tmp_path / "out"
    out.mkdir()
    ids = export.write_tokenizer(("hf", src), out, VOCAB, max_length=64)
    assert (ids["eos_token_id"], ids["pad_token_id"]) == (eos, eos), (ids, eos)
    tok = PreTrainedTokenizerFast.from_pretrained(str(out))
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == (pipeline.id_to_piece(eos), eos, eos)


def test_a_tokenizer_with_more_tokens_than_the_model_is_refused(tmp_path):
    """A tokenizer whose ids reach past the model's vocab_size would index past the embedding: refused,
    naming both sizes."""
    from tests.support.data_fixtures import train_hf_bpe

    src = train_hf_bpe([t * (1 + i % 3) for i, t in enumerate(TEXTS * 8)], tmp_path / "bpe", vocab_size=VOCAB)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ConversionError, match=r"has \d+ tokens, more than the model's vocab_size=100"):
        export.write_tokenizer(("hf", src), out, 100, max_length=64)



# ---------------------------------------------------------------------- the --standard config
def test_the_standard_config_keeps_the_biases_its_family_does_not_imply(tmp_path):
    """--standard of a Llama-class recipe with a bias in every linear layer is a Llama with attention_bias
    and mlp_bias (LlamaForCausalLM builds those biases only when told); with q/k/v biases alone it is a
    Qwen2, whose modelling code has exactly those biases, so its config names neither field."""
    from transformers import LlamaConfig

    from fbt_megatron.recipe import load_recipe
    from tests.support.training import tiny_recipe

    llama = dict(activation="swiglu", normalization="RMSNorm", num_query_groups=2)
    biased = load_recipe(data=tiny_recipe(tmp_path, model=dict(llama, add_bias_linear=True)))
    cfg = export.standard_hf_config(biased, {}, {}, "fp32")
    assert (cfg["model_type"], cfg["attention_bias"], cfg["mlp_bias"]) == ("llama", True, True), cfg
    built = LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    assert built.attention_bias and built.mlp_bias
    qkv = load_recipe(data=tiny_recipe(tmp_path, model=dict(llama, add_bias_linear=False, add_qkv_bias=True)))
    cfg = export.standard_hf_config(qkv, {}, {}, "fp32")
    assert cfg["model_type"] == "qwen2" and not {"attention_bias", "mlp_bias"} & set(cfg), cfg


# ---------------------------------------------------------------------- the bounded mixin's W_U
def test_a_bounded_w_u_exports_inside_the_unit_ball_and_reimports_bit_for_bit():
    """Under ``mixin: bounded`` the model applies W_U / max(1, sigma_max(W_U)): the export writes W_U so
    applied (the trained model's map, to float32 rounding), its spectral norm at most 1, so that an import,
    which applies the bound again, leaves it bit for bit, and so does a second export of that import; a W_U
    inside the unit ball or on its edge is written as it is. At width 128 (test_feedback_rule checks 64):
    rounding grows with the width."""
    bounded = SimpleNamespace(mixin="bounded")
    for seed in range(40):
        w = torch.randn(128, 128, generator=torch.Generator().manual_seed(seed)) * (1.0 + seed / 10)
        sigma = torch.linalg.matrix_norm(w, ord=2)  # sigma_max about 23-100
        exported = export.as_applied("feedback.value.weight", w, bounded)
        torch.testing.assert_close(exported, w / sigma, rtol=4e-6, atol=0)
        again = torch.linalg.matrix_norm(exported.float(), ord=2)
        assert again <= 1.0, (seed, float(again) - 1)
        assert torch.equal(exported / again.clamp_min(1.0), exported), seed  # what an import applies
        if seed % 4 == 0:  # export -> from-hf -> to-hf: the second export writes the same W_U
            assert torch.equal(export.as_applied("feedback.value.weight", exported, bounded), exported), seed
    inside = torch.randn(128, 128, generator=torch.Generator().manual_seed(99)) * 0.01
    assert torch.equal(export.as_applied("feedback.value.weight", inside, bounded), inside)
    # on the bound itself (sigma exactly 1: an identity init at scale 1, value_init_scale: 1.0): as it is
    identity = torch.eye(128)
    assert torch.equal(export.as_applied("feedback.value.weight", identity, bounded), identity)
    # just past it: divided by sigma all the same
    q = torch.linalg.qr(torch.randn(128, 128, generator=torch.Generator().manual_seed(5)))[0]
    for sigma in (1.001, 1.5, 2.0, 3.0):
        w = q @ torch.diag(torch.linspace(0.1, sigma, 128)) @ q.T
        exported = export.as_applied("feedback.value.weight", w, bounded)
        torch.testing.assert_close(exported, w / sigma, rtol=4e-6, atol=1e-7)
        assert torch.linalg.matrix_norm(exported, ord=2) <= 1.0, sigma
    assert torch.equal(export.as_applied("feedback.value.weight", w, SimpleNamespace(mixin="affine")), w)


def test_cli_passes_the_shard_size_given_and_otherwise_the_librarys_default(monkeypatch):
    """``fbt convert to-hf --max-shard-size 500MB`` exports with 500 * 10**6-byte shards; without the flag the
    library's own default applies (one default, in export.py)."""
    from fbt_megatron import runtime
    from fbt_megatron.hf import cli

    calls = []
    monkeypatch.setattr(export, "export_checkpoint", lambda *a, **k: calls.append(k))
    monkeypatch.setattr(runtime, "init_distributed", lambda *a, **k: None)
    monkeypatch.setattr(runtime, "shutdown", lambda *a, **k: None)
    assert cli.main(["to-hf", "ck", "out", "--max-shard-size", "500MB"]) == 0
    assert cli.main(["to-hf", "ck", "out", "--max-shard-size", "1GiB"]) == 0
    assert cli.main(["to-hf", "ck", "out"]) == 0
    assert [c.get("max_shard_bytes") for c in calls] == [500 * 10**6, 2**30, None]


def test_standard_export_of_a_family_with_implied_fields_falls_back_to_llama():
    """A model imported from Qwen2 that no longer has q/k/v-only biases is not a Qwen2 (whose modelling
    code implies those biases): its --standard export is written as Llama. Mistral implies nothing and stays."""
    from fbt_megatron.hf.families import FAMILIES, standard_family

    plain = SimpleNamespace(add_qkv_bias=False, add_bias_linear=False)
    assert standard_family(plain, "qwen2") is FAMILIES["llama"]
    assert standard_family(plain, "mistral") is FAMILIES["mistral"]
    assert standard_family(SimpleNamespace(add_qkv_bias=True, add_bias_linear=False), None) is FAMILIES["qwen2"]
