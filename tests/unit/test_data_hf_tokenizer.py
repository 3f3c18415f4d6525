"""`fbt data prepare --tokenizer` with a Hugging Face tokenizer (a tokenizer.json or a model directory):
the shards hold the ids transformers' own fast tokenizer gives (no special tokens; each document ends with
the tokenizer's EOS in the stream), the identity is the hash of its files and the loader refuses another,
and `to-hf` writes the tokenizer back unchanged (the same ids)."""

import json
import shutil

import numpy as np
import pytest

from data_pipeline.errors import TokenizerMismatchError
from tests.support.data_fixtures import train_hf_bpe

TEXTS = ["def add(a, b):\n\treturn a + b\n", "  two  spaces and 12345 digits", "x = 'mixed' + \"quotes\"\n",
         "The river ran past the stone garden; seven windows, twelve lights.", "naïve café — ünïcödé ✓"]
CORPUS = [t * (1 + i % 3) for i, t in enumerate(TEXTS * 8)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return train_hf_bpe(CORPUS, tmp_path_factory.mktemp("tok") / "llama3ish")


def _reference(tok_dir):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))


def test_prepare_with_hf_tokenizer_gives_transformers_ids(tok_dir, tmp_path):
    from data_pipeline.prepare import prepare_dataset
    from data_pipeline.shards import Dataset, DatasetReader
    from data_pipeline.tokenizer import tokenizer_hash

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    index = prepare_dataset([str(src)], tmp_path / "ds", tok_dir, num_workers=2, shard_bytes=400, progress=False)
    ref = _reference(tok_dir)
    assert index["tokenizer_hash"] == tokenizer_hash(tok_dir) and index["num_shards"] > 1
    assert index["eos_id"] == ref.convert_tokens_to_ids("<|end_of_text|>")
    reader = DatasetReader(Dataset.load(tmp_path / "ds", tokenizer_hash=index["tokenizer_hash"]))
    for sid, text in enumerate(CORPUS):
        assert reader.get(sid).tolist() == ref.encode(text, add_special_tokens=False)
    reader.close()

    # Another tokenizer (the same tokenizer.json with another EOS in its config) is another identity.
    other = tmp_path / "other"
    shutil.copytree(tok_dir, other)
    (other / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|begin_of_text|>"}))
    with pytest.raises(TokenizerMismatchError, match=f"built with tokenizer {index['tokenizer_hash']}"):
        Dataset.load(tmp_path / "ds", tokenizer_hash=tokenizer_hash(other))


def test_hf_tokenizer_eos_rule(tok_dir, tmp_path):
    from data_pipeline.tokenizer import load_tokenizer

    bare = tmp_path / "bare" / "tokenizer.json"  # no config: the first known EOS name in the vocabulary
    bare.parent.mkdir()
    shutil.copyfile(tok_dir / "tokenizer.json", bare)
    ref = _reference(tok_dir)
    assert load_tokenizer(bare).eos_id() == ref.convert_tokens_to_ids("<|end_of_text|>")
    assert load_tokenizer(tok_dir).bos_id() == ref.convert_tokens_to_ids("<|begin_of_text|>")
    data = json.loads(bare.read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<|end_of_text|>"]
    vocab = data["model"]["vocab"]
    vocab.pop("<|end_of_text|>", None)
    bare.write_text(json.dumps(data))
    with pytest.raises(TokenizerMismatchError, match="has no EOS token"):
        load_tokenizer(bare)
    (bare.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(TokenizerMismatchError, match="eos_token '<\\|nope\\|>' is not in its vocabulary"):
        load_tokenizer(bare.parent)


def test_to_hf_writes_the_tokenizer_back_unchanged(tok_dir, tmp_path):
    """A bare tokenizer.json (no config) and a model directory both come back byte-identical, with the
    same ids, and the export names the data pipeline's EOS."""
    from transformers import PreTrainedTokenizerFast

    from fbt_megatron.hf.export import given_tokenizer, write_tokenizer

    ref = _reference(tok_dir)
    for name, source in (("dir", tok_dir), ("file", tok_dir / "tokenizer.json")):
        out = tmp_path / name
        out.mkdir()
        tokens = write_tokenizer(given_tokenizer(source), out, vocab_size=1000, max_length=64)
        assert (out / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
        back = PreTrainedTokenizerFast.from_pretrained(str(out))
        assert tokens["eos_token_id"] == ref.convert_tokens_to_ids("<|end_of_text|>") == back.eos_token_id
        for text in TEXTS:
            assert back.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)


def test_data_tokenizer_load_copies_a_model_directory(tok_dir, tmp_path, capsys):
    """`fbt data tokenizer --load DIR --out OUT`: OUT gets the tokenizer's files and the same identity."""
    from data_pipeline.tokenizer import tokenizer_hash
    from fbt_megatron.cli import main

    assert main(["data", "tokenizer", "--load", str(tok_dir), "--out", str(tmp_path / "copy")]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["hash"] == tokenizer_hash(tok_dir) == tokenizer_hash(tmp_path / "copy")
    assert printed["eos_id"] == _reference(tok_dir).convert_tokens_to_ids("<|end_of_text|>")


def test_batches_encode_without_offsets_to_the_same_ids(tok_dir):
    """A batch goes through the library's encode_batch_fast (no character offsets: nothing reads them) and
    gives encode_batch's ids."""
    from tokenizers import Tokenizer

    from data_pipeline.tokenizer import load_tokenizer

    tk = load_tokenizer(tok_dir)
    calls = []

    class Spy:  # the Rust class cannot be patched: a proxy that records the batch calls
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            if name.startswith("encode_batch"):
                calls.append(name)
            return getattr(self.inner, name)

    tk.tk = Spy(tk.tk)
    batch = CORPUS + ["", "a <|end_of_text|> inside a text"]
    ids = tk.encode(batch)
    assert calls == ["encode_batch_fast"]
    ref = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert ids == [e.ids for e in ref.encode_batch(batch, add_special_tokens=False)]


def _with_bos_post_processor(tok_dir, out):
    """The tokenizer with Llama 3's post-processor: <|begin_of_text|> before every text; no config file."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    tk = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    bos = tk.token_to_id("<|begin_of_text|>")
    tk.post_processor = TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
                                           special_tokens=[("<|begin_of_text|>", bos)])
    out.mkdir()
    tk.save(str(out / "tokenizer.json"))
    return out, bos


@pytest.mark.parametrize("mode", ["no", "yes", "auto"])
def test_bos_option(tok_dir, tmp_path, mode):
    """--bos: no BOS (default), the tokenizer's BOS, or what its post-processor adds (auto), for every
    document, recorded in the index; `yes` without a BOS is refused naming the tokenizer."""
    from data_pipeline.prepare import prepare_dataset
    from data_pipeline.shards import Dataset, DatasetReader
    from data_pipeline.tokenizer import load_tokenizer

    docs = [(f"d{i}", t) for i, t in enumerate(CORPUS)]
    ref = load_tokenizer(tok_dir)
    bos = ref.bos_id()
    assert bos == ref.tk.token_to_id("<|begin_of_text|>") and ref.added_bos() is None  # no post-processor
    with_pp, pp_bos = _with_bos_post_processor(tok_dir, tmp_path / "pp")
    assert load_tokenizer(with_pp).added_bos() == pp_bos == bos
    want_first = {"no": None, "yes": bos, "auto": None}[mode]
    for tok, first in ((tok_dir, want_first), (with_pp, None if mode == "no" else bos)):
        out = tmp_path / f"{mode}-{tok.name}"
        idx = prepare_dataset([], out, tok, documents=iter(docs), shard_bytes=500, progress=False, bos=mode)
        assert idx["bos_added_id"] == first
        reader = DatasetReader(Dataset.load(out))
        for sid, (_, text) in enumerate(docs):
            body = ref.encode(text)
            assert reader.get(sid).tolist() == ([] if first is None else [first]) + body
    bare = train_hf_bpe(CORPUS, tmp_path / "bare", config=False)  # no tokenizer_config.json, no post-processor
    if mode == "yes":
        with pytest.raises(TokenizerMismatchError, match=f"--bos yes: tokenizer {bare} has no BOS token"):
            prepare_dataset([], tmp_path / "bare-out", bare, documents=iter(docs), progress=False, bos=mode)
        assert not (tmp_path / "bare-out").exists()


def _word_level(tmp_path, *, post_processor=None, added=()):
    """A tiny word-level tokenizer.json built with ``tokenizers``: its own post-processor, added specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", "</s>", "a", "b", "c"])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    if added:
        tk.add_special_tokens(list(added))
    if post_processor is not None:
        tk.post_processor = post_processor(tk)
    out = tmp_path / "wl"
    out.mkdir()
    tk.save(str(out / "tokenizer.json"))
    return out, vocab


def test_a_post_processor_that_only_appends_eos_adds_no_bos(tmp_path):
    """`--bos auto` takes a BOS only from a post-processor that puts one before the text: one that appends
    EOS lengthens the encoding too, but its first id is the text's own."""
    from tokenizers.processors import TemplateProcessing

    from data_pipeline.prepare import prepare_dataset
    from data_pipeline.shards import Dataset, DatasetReader
    from data_pipeline.tokenizer import load_tokenizer, resolve_bos

    eos_after = lambda tk: TemplateProcessing(single="$A </s>", special_tokens=[("</s>", tk.token_to_id("</s>"))])  # noqa: E731
    tok_dir, vocab = _word_level(tmp_path, post_processor=eos_after)
    tok = load_tokenizer(tok_dir)
    assert tok.tk.encode("a", add_special_tokens=True).ids == [vocab["a"], vocab["</s>"]]  # the post-processor ran
    assert tok.added_bos() is None and resolve_bos(tok, "auto", tok_dir) is None
    idx = prepare_dataset([], tmp_path / "ds", tok_dir, documents=iter([("d0", "a b"), ("d1", "c a")]),
                          progress=False, bos="auto")
    reader = DatasetReader(Dataset.load(tmp_path / "ds"))
    assert idx["bos_added_id"] is None and reader.get(0).tolist() == [vocab["a"], vocab["b"]]
    reader.close()


def test_vocab_size_counts_added_special_tokens(tmp_path):
    """Added tokens (Llama 3's reserved specials are such) have ids past the model's vocabulary: the
    vocabulary size (the model's embedding rows, the token dtype) counts them."""
    from tokenizers import AddedToken

    from data_pipeline.tokenizer import load_tokenizer

    specials = [AddedToken(f"<|reserved_special_token_{i}|>", special=True) for i in range(3)]
    tok_dir, vocab = _word_level(tmp_path, added=specials)
    tok = load_tokenizer(tok_dir)
    ids = [tok.tk.token_to_id(t.content) for t in specials]
    assert ids == [len(vocab), len(vocab) + 1, len(vocab) + 2]
    assert tok.vocab_size() == tok.get_piece_size() == len(vocab) + 3 == max(ids) + 1
