"""Sentencepiece tokenizer: training, loading and identity.

The identity of a tokenizer is the SHA-256 of its ``.model`` file (first 16 hex digits). Every shard
index records it; the loader refuses a dataset whose index names another tokenizer, and the loader
state carries it so the trainer can refuse a checkpoint made with another one.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import sentencepiece as spm

from .errors import SourceError, TokenizerMismatchError


def tokenizer_hash(model_path: str | os.PathLike) -> str:
    path = Path(model_path)
    if not path.is_file():
        raise TokenizerMismatchError(f"tokenizer model not found: {path}")
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def load_tokenizer(model_path: str | os.PathLike) -> spm.SentencePieceProcessor:
    path = Path(model_path)
    if not path.is_file():
        raise TokenizerMismatchError(f"tokenizer model not found: {path}")
    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(str(path))
    except Exception as exn:  # sentencepiece raises OSError/RuntimeError with little context
        raise TokenizerMismatchError(f"cannot load sentencepiece model {path}: {exn}") from exn
    if sp.eos_id() < 0:
        raise TokenizerMismatchError(f"tokenizer {path} has no EOS piece; the packer needs one")
    return sp


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
    tmp = out_model.with_suffix(out_model.suffix + ".tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, out_model)
    return tokenizer_hash(out_model)
