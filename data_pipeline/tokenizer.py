"""Tokenizers: sentencepiece (training, loading) and Hugging Face ``tokenizers``, and their identity.

A tokenizer is a sentencepiece ``.model``, a Hugging Face ``tokenizer.json``, or a model directory
holding either (``tokenizer.json`` first). The identity of a tokenizer is the SHA-256 of its files
(first 16 hex digits; one file: of its bytes): the ``.model``, or ``tokenizer.json`` with the
directory's ``tokenizer_config.json`` and ``special_tokens_map.json``. Every shard index records it;
the loader refuses a dataset whose index names another tokenizer, and the loader state carries it so
the trainer can refuse a checkpoint made with another one.

Special tokens: documents are encoded without any (the tokenizer's own post-processor is not applied:
``add_special_tokens=False``), and the packer ends each document with the tokenizer's EOS. A BOS
before each document is a choice of ``fbt data prepare --bos`` (:func:`resolve_bos`): ``no`` (the
default), ``yes`` (the tokenizer's BOS), or ``auto``: what the tokenizer itself adds, read from a Hugging
Face tokenizer's post-processor (Llama 3's tokenizer.json puts ``<|begin_of_text|>`` first, Llama 2 and
Mistral ``<s>``, Qwen2's none); a sentencepiece model adds none unless asked.
A Hugging Face tokenizer's EOS is ``tokenizer_config.json``'s ``eos_token`` in a model directory,
else the first of :data:`EOS_NAMES` in the vocabulary (Llama 3's base ``<|end_of_text|>``, GPT-2 and
Qwen's ``<|endoftext|>``, Llama 2 and Mistral's ``</s>``); without one it is refused.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import sentencepiece as spm

from .errors import SourceError, TokenizerMismatchError


HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")


def tokenizer_files(path: str | os.PathLike) -> dict[str, Path]:
    """{name: file} of the tokenizer at ``path`` (see the module docstring): what its identity hashes
    and what travels with checkpoints under these names."""
    path = Path(path)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return {n: path / n for n in HF_TOKENIZER_FILES if (path / n).is_file()}
        if (path / "tokenizer.model").is_file():
            return {"tokenizer.model": path / "tokenizer.model"}
        raise TokenizerMismatchError(f"tokenizer directory {path} holds neither tokenizer.json nor tokenizer.model")
    if not path.is_file():
        raise TokenizerMismatchError(f"tokenizer model not found: {path}")
    return {"tokenizer.json" if path.suffix == ".json" else "tokenizer.model": path}


def tokenizer_hash(model_path: str | os.PathLike) -> str:
    files = tokenizer_files(model_path)
    if len(files) == 1:
        return hashlib.sha256(next(iter(files.values())).read_bytes()).hexdigest()[:16]
    h = hashlib.sha256()
    for name in sorted(files):
        data = files[name].read_bytes()
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:16]


def _special(value) -> str | None:
    """A special token as tokenizer_config.json writes it (a string or an AddedToken dict)."""
    return value.get("content") if isinstance(value, dict) else value


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer behind the sentencepiece calls the pipeline makes
    (``encode`` of a text or a batch, ``decode``, ``eos_id``, ``bos_id``, ``vocab_size``/``get_piece_size``).
    A batch is encoded by ``encode_batch_fast`` (no offsets): the library's own (Rayon) threads."""

    def __init__(self, files: dict[str, Path]):
        import json

        from tokenizers import Tokenizer

        self.path = files["tokenizer.json"]
        try:
            self.tk = Tokenizer.from_file(str(self.path))
        except Exception as exn:
            raise TokenizerMismatchError(f"cannot load Hugging Face tokenizer {self.path}: {exn}") from exn
        config = {}
        if "tokenizer_config.json" in files:
            try:
                config = json.loads(files["tokenizer_config.json"].read_text())
            except (OSError, ValueError) as exn:
                raise TokenizerMismatchError(f"cannot read {files['tokenizer_config.json']}: {exn}") from exn
        eos = _special(config.get("eos_token"))
        if eos is None:
            eos = next((t for t in EOS_NAMES if self.tk.token_to_id(t) is not None), None)
        if eos is None or self.tk.token_to_id(eos) is None:
            raise TokenizerMismatchError(
                f"tokenizer {self.path} has no EOS token (" + (f"eos_token {eos!r} is not in its vocabulary"
                if eos else f"no tokenizer_config.json eos_token and none of {list(EOS_NAMES)}") + "); the packer needs one")
        self._eos = self.tk.token_to_id(eos)
        bos = _special(config.get("bos_token"))
        self._bos = self.tk.token_to_id(bos) if bos else None

    def encode(self, text, num_threads: int | None = None):
        """Ids of a text, or a list of id lists for a list of texts; no special tokens added.
        ``num_threads`` is sentencepiece's argument, ignored (the library sizes its own pool)."""
        if isinstance(text, str):
            return self.tk.encode(text, add_special_tokens=False).ids
        # encode_batch_fast (tokenizers >= 0.21): the same ids without character offsets, which nothing
        # here reads (they cost a fifth of the encoding time)
        encode = getattr(self.tk, "encode_batch_fast", None) or self.tk.encode_batch
        return [e.ids for e in encode(list(text), add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=False)

    def eos_id(self) -> int:
        return self._eos

    def bos_id(self) -> int:
        """``tokenizer_config.json``'s ``bos_token``, else the BOS the post-processor adds, else -1."""
        if self._bos is None:
            added = self.added_bos()
            return -1 if added is None else added
        return self._bos

    def added_bos(self) -> int | None:
        """The id the tokenizer's own post-processor puts before a text (``add_special_tokens=True``, what
        transformers' ``tokenizer(text)`` does), or None."""
        bare = self.tk.encode("a", add_special_tokens=False).ids
        full = self.tk.encode("a", add_special_tokens=True).ids
        return full[0] if len(full) > len(bare) and full[1:1 + len(bare)] == bare else None

    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    get_piece_size = vocab_size

    def id_to_piece(self, i: int) -> str:
        return self.tk.id_to_token(i)


def load_tokenizer(model_path: str | os.PathLike):
    """A ``SentencePieceProcessor`` for a ``.model``, an :class:`HFTokenizer` for a ``tokenizer.json``
    (or a directory holding one)."""
    files = tokenizer_files(model_path)
    if "tokenizer.json" in files:
        return HFTokenizer(files)
    path = files["tokenizer.model"]
    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(str(path))
    except Exception as exn:  # sentencepiece raises OSError/RuntimeError with little context
        raise TokenizerMismatchError(f"cannot load sentencepiece model {path}: {exn}") from exn
    if sp.eos_id() < 0:
        raise TokenizerMismatchError(f"tokenizer {path} has no EOS piece; the packer needs one")
    return sp


BOS_MODES = ("no", "yes", "auto")


def resolve_bos(tok, mode: str, where) -> int | None:
    """The id each document starts with under ``fbt data prepare --bos MODE`` (module docstring), or None;
    ``yes`` with a tokenizer that has no BOS is refused naming it."""
    if mode not in BOS_MODES:
        raise SourceError(f"--bos {mode!r}: choose from {', '.join(BOS_MODES)}")
    if mode == "no":
        return None
    if mode == "auto":
        return tok.added_bos() if isinstance(tok, HFTokenizer) else None
    if tok.bos_id() < 0:
        raise TokenizerMismatchError(f"--bos yes: tokenizer {where} has no BOS token (no bos_token in its "
                                     "tokenizer_config.json, none added by its post-processor)")
    return int(tok.bos_id())


def _sentences(texts: Iterable[str], max_sentences: int, max_len: int) -> Iterator[str]:
    n = 0
    for text in texts:
        for line in text.split("\n"):
            line = line.rstrip()
            if not line.strip():
                continue
            yield line[:max_len]
            n += 1
            if n >= max_sentences:
                return


def train_tokenizer(
    texts: Iterable[str],
    out_model: str | os.PathLike,
    *,
    vocab_size: int = 4096,
    model_type: str = "bpe",
    max_sentences: int = 300_000,
    num_threads: int | None = None,
    seed_sentencepiece_size: int = 200_000,
) -> str:
    """Train a sentencepiece model (byte fallback, digits split, whitespace kept) from ``texts``.

    ``texts`` are whole documents; training sees their non-empty lines. Writes ``out_model`` (a
    ``.model`` path) and returns its identity hash.
    """
    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"model_type must be 'bpe' or 'unigram', got {model_type!r}")
    out_model = Path(out_model)
    out_model.parent.mkdir(parents=True, exist_ok=True)
    sentences = list(_sentences(texts, max_sentences, 4000))
    if not sentences:
        raise SourceError("tokenizer training input holds no text")
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=buf,
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=True,
            split_digits=True,
            character_coverage=0.9995,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            user_defined_symbols=["\n", "\t"],
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            max_sentence_length=16384,
            input_sentence_size=max_sentences,
            shuffle_input_sentence=True,
            seed_sentencepiece_size=seed_sentencepiece_size,
            hard_vocab_limit=False,
            num_threads=num_threads or max(1, os.cpu_count() or 1),
            minloglevel=2,
        )
    except RuntimeError as err:  # sentencepiece's own check, e.g. fewer pieces than the text's characters
        found = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", str(err))
        if found is None:
            raise
        raise SourceError(f"--vocab-size {found[1]} is smaller than the {found[2]} characters and special pieces "
                          f"the text needs: raise --vocab-size to at least {found[2]}") from None
    tmp = out_model.with_suffix(out_model.suffix + ".tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, out_model)
    return tokenizer_hash(out_model)
