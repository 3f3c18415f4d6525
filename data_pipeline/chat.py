"""Conversations for instruction tuning: the chat template, its per-token loss mask, and
``fbt data prepare --format chat``.

A conversation is a JSONL row ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``.
It is rendered by a Jinja chat template — rendered and tokenized by transformers'
``apply_chat_template`` on the fast tokenizer converted from the run's sentencepiece model, or on the
run's Hugging Face ``tokenizer.json`` itself, the same code path an HF export's
``tokenizer.apply_chat_template`` runs, so training data, ``fbt generate
--chat`` and the export agree token for token. The template marks each assistant turn (its content
and its end-of-turn token, EOS) with ``{% generation %}``; transformers returns those tokens as the
``assistant_masks``, which become the document's per-token loss mask: only they are trained.

A chat dataset is an ordinary prepared dataset (same shards, index and loader) whose samples carry a
second member ``<key>.mask.npy`` (uint8, one flag per token) and whose ``index.json`` ``meta`` holds
``format: chat`` and the chat template's text (the template travels with the data and, from there,
with every SFT checkpoint next to ``tokenizer.model`` as ``chat_template.jinja``).

Bad rows are never dropped silently: each is counted by kind (``BAD_KINDS``) and reported, with the
first line of each kind; ``strict`` makes the first one an error.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .errors import DataError, EmptySourceError, SourceError

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
BAD_KINDS = ("invalid_json", "not_a_conversation", "unknown_role", "no_assistant_turn", "too_long")
# the kinds in words (too_long, which names the limit, is worded where it is known)
BAD_KIND_WORDS = {"invalid_json": "not JSON", "not_a_conversation": "not a conversation",
                  "unknown_role": "a role other than system, user and assistant",
                  "no_assistant_turn": "no assistant turn"}
TEMPLATE_FILE = "chat_template.jinja"

# Zephyr-style turns: a role header line, the content, EOS as the end-of-turn token. The assistant's
# content and its EOS are inside {% generation %}: they, and only they, carry loss.
DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + eos_token }}{%- endgeneration %}"
    "{%- else %}"
    "{{- message['content'] + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)


class ChatError(DataError):
    """A bad conversation (under ``strict``), a template that cannot render, or a chat dataset without
    its template."""


def template_sha(template: str) -> str:
    return hashlib.sha256(template.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------- tokenizer
def sentencepiece_fast_tokenizer(model_bytes: bytes):
    """transformers' fast tokenizer of a sentencepiece model (its bytes) that encodes like SentencePiece:
    byte fallback, dummy prefix, user-defined pieces, BOS/EOS/UNK named, no BOS added (the data
    pipeline adds none). ``fbt convert to-hf`` saves this one (``hf.export.write_tokenizer``), the chat
    code renders with it: both give the same ids. A new one per call."""
    import sentencepiece as spm
    from transformers import PreTrainedTokenizerFast

    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(model_bytes)
    staging = Path(tempfile.mkdtemp(prefix="fbt-sp-tok-"))
    try:
        (staging / "tokenizer.model").write_bytes(model_bytes)
        piece = lambda i: sp.id_to_piece(i) if i >= 0 else None  # noqa: E731
        return PreTrainedTokenizerFast.from_pretrained(str(staging), bos_token=piece(sp.bos_id()),
                                                       eos_token=piece(sp.eos_id()), unk_token=piece(sp.unk_id()),
                                                       local_files_only=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@functools.lru_cache(maxsize=4)
def _fast_tokenizer(model_bytes: bytes, template: str):
    """:func:`sentencepiece_fast_tokenizer` with the chat template set (cached)."""
    tok = sentencepiece_fast_tokenizer(model_bytes)
    tok.chat_template = template
    return tok


@functools.lru_cache(maxsize=4)
def _hf_fast_tokenizer(tokenizer_json: str, digest: str, eos: str, bos: str | None, template: str):
    """transformers' fast tokenizer over a Hugging Face ``tokenizer.json`` (its own file, the same ids),
    EOS/BOS named as the data pipeline resolved them, the chat template set (cached; ``digest``: the
    file's identity, so a rewritten file is not served from the cache)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=tokenizer_json, eos_token=eos, bos_token=bos)
    tok.chat_template = template
    return tok


def chat_tokenizer(model, template: str | None = None):
    """The fast tokenizer that renders chats, with ``template`` set (default :data:`DEFAULT_CHAT_TEMPLATE`).
    ``model``: a sentencepiece model's bytes, a tokenizer path (a ``.model``, a Hugging Face
    ``tokenizer.json`` or a model directory of either) or a tokenizer ``load_tokenizer`` returned. A
    sentencepiece model is converted (:func:`sentencepiece_fast_tokenizer`); a Hugging Face tokenizer is
    its own ``tokenizer.json``, its EOS the one the data pipeline ends documents with. Cached per
    (tokenizer, template): do not modify it."""
    from .tokenizer import HFTokenizer, load_tokenizer, tokenizer_files, tokenizer_hash

    template = template or DEFAULT_CHAT_TEMPLATE
    if isinstance(model, bytes):
        return _fast_tokenizer(model, template)
    if hasattr(model, "serialized_model_proto"):  # a loaded sentencepiece processor
        return _fast_tokenizer(model.serialized_model_proto(), template)
    if not isinstance(model, HFTokenizer):
        files = tokenizer_files(model)
        if "tokenizer.json" not in files:
            return _fast_tokenizer(files["tokenizer.model"].read_bytes(), template)
        model = load_tokenizer(model)
    bos = model.bos_id()
    return _hf_fast_tokenizer(str(model.path), tokenizer_hash(model.path), model.id_to_piece(model.eos_id()),
                              model.id_to_piece(bos) if bos >= 0 else None, template)


def check_template(template: str, where: str = "chat template") -> None:
    """A template must parse and must mark assistant turns with {% generation %} (the loss mask)."""
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as exn:
        if "generation" not in str(exn):
            raise ChatError(f"{where}: not a valid Jinja template: {exn}") from None
    if "{% generation %}" not in template.replace("{%-", "{%").replace("-%}", "%}"):
        raise ChatError(f"{where}: the template marks no assistant turn with {{% generation %}} ... "
                        f"{{% endgeneration %}}; without it no token would carry loss")


def encode_conversation(tok, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, loss mask) of a whole conversation: 1 on assistant tokens and their end-of-turn."""
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids = np.asarray(out["input_ids"], np.int64)
    mask = np.asarray(out["assistant_masks"], np.uint8)
    return ids, mask


def prompt_ids(tok, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` followed by the assistant header (``add_generation_prompt``): what a
    chat model continues. The same call an HF export's tokenizer makes."""
    return list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))


def chat_messages(user: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


# ---------------------------------------------------------------------------------- validation
def bad_kind(row) -> str | None:
    """Why a parsed JSONL row is not a trainable conversation (a kind of :data:`BAD_KINDS`), or None."""
    msgs = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(msgs, list) or not msgs:
        return "not_a_conversation"
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
            return "not_a_conversation"
    if any(m["role"] not in ROLES for m in msgs):
        return "unknown_role"
    if not any(m["role"] == "assistant" for m in msgs):
        return "no_assistant_turn"
    return None


def _jsonl_files(paths) -> list[Path]:
    from .sources import expand_paths

    files = [f for f in expand_paths(paths) if f.suffix in (".jsonl", ".json")]
    if not files:
        raise SourceError(f"no .jsonl files in {', '.join(map(str, paths))}")
    return files


def iter_conversations(paths, tok, *, max_tokens: int, bad: dict, strict: bool = False):
    """``(doc_id, ids, loss_mask)`` of every good conversation in the JSONL files behind ``paths``;
    ``bad`` gets ``{kind: count}`` and ``first_bad`` ``{kind: "file:line"}``. ``strict`` raises
    :class:`ChatError` at the first bad row."""
    counts = bad.setdefault("counts", {k: 0 for k in BAD_KINDS})
    first = bad.setdefault("first", {})
    for f in _jsonl_files(paths):
        with open(f, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{f}:{n}"
                try:
                    row = json.loads(line)
                    kind = bad_kind(row)
                except json.JSONDecodeError:
                    row, kind = None, "invalid_json"
                ids = mask = None
                if kind is None:
                    ids, mask = encode_conversation(tok, row["messages"])
                    if len(ids) > max_tokens:
                        kind = "too_long"
                if kind is not None:
                    if strict:
                        detail = f" ({len(ids)} tokens > --max-tokens {max_tokens})" if kind == "too_long" else ""
                        raise ChatError(f"{where}: bad conversation: {kind}{detail} (--strict)")
                    counts[kind] += 1
                    first.setdefault(kind, where)
                    continue
                doc_id = row.get("id") if isinstance(row.get("id"), str) else f"{f.name}:{n}"
                yield doc_id, ids, mask


def prepare_chat(paths, out_dir, tokenizer, *, chat_template: str | None = None, max_tokens: int = 2048,
                 strict: bool = False, name: str | None = None, shard_bytes: int = 16 << 20,
                 num_workers: int = 1, progress: bool = True, overwrite: bool = False) -> dict:
    """Write a chat dataset (see the module docstring); returns its index, ``meta.bad_rows`` included.
    ``out_dir`` and ``overwrite``: as :func:`prepare.prepare_dataset`."""
    from .prepare import _input_fingerprint, prepare_dataset
    from .tokenizer import load_tokenizer

    template = chat_template or DEFAULT_CHAT_TEMPLATE
    check_template(template)
    tok = chat_tokenizer(load_tokenizer(tokenizer), template)  # load_tokenizer validates (EOS present)
    # ``bad`` is filled while the documents are read; prepare_dataset records ``meta`` in index.json
    # after the last one (its resume settings were written before the first, with the same keys)
    bad: dict = {"counts": {k: 0 for k in BAD_KINDS}, "first": {}}
    meta = {"format": "chat", "loss_mask": True, "chat_template": template, "chat_template_sha": template_sha(template),
            "max_tokens": int(max_tokens), "inputs": _input_fingerprint(list(paths)), "bad_rows": bad}
    docs = iter_conversations(paths, tok, max_tokens=max_tokens, bad=bad, strict=strict)
    try:
        index = prepare_dataset(list(paths), out_dir, tokenizer, name=name, shard_bytes=shard_bytes,
                                num_workers=num_workers, progress=progress, documents=docs, extra_meta=meta,
                                overwrite=overwrite)
    except EmptySourceError:
        counts = {k: v for k, v in bad["counts"].items() if v}
        if not counts:
            raise
        words = {**BAD_KIND_WORDS, "too_long": f"longer than --max-tokens {max_tokens}"}
        found = "; ".join(f"{words[k]}: {v}, the first at {bad['first'][k]}" for k, v in counts.items())
        fix = ("raise --max-tokens" if set(counts) == {"too_long"} else
               'each line must hold {"messages": [{"role": ..., "content": ...}, ...]} with an assistant turn')
        raise ChatError(f"no row of {', '.join(map(str, paths))} can be used ({found}); {fix}: nothing was "
                        "written") from None
    nbad = sum(bad["counts"].values())
    if nbad:
        log.warning("chat source %s: %d bad conversations not written: %s (first of each: %s)", index["name"],
                    nbad, {k: v for k, v in bad["counts"].items() if v}, bad["first"])
    return index


# ---------------------------------------------------------------------------------- datasets
def dataset_chat_template(path: str | os.PathLike, name: str | None = None) -> str | None:
    """The chat template of a prepared dataset; None for a plain-text one. A dataset whose samples carry
    a loss mask but whose index holds no template is refused, naming it."""
    ipath = Path(path) / "index.json"
    try:
        meta = json.loads(ipath.read_text()).get("meta") or {}
    except (OSError, json.JSONDecodeError) as exn:
        raise ChatError(f"source {name or path!r}: cannot read {ipath}: {exn}") from None
    if meta.get("format") != "chat" and not meta.get("loss_mask"):
        return None
    template = meta.get("chat_template")
    if not isinstance(template, str) or not template.strip():
        raise ChatError(f"source {name or path!r} ({path}) is a chat dataset without a chat template "
                        f"(index.json meta.chat_template); prepare it again with `fbt data prepare --format chat`")
    return template


def sources_chat_template(cfg, *, require: bool) -> str | None:
    """The one chat template of a ``DataConfig``'s sources. ``require`` (SFT): every source must be a
    chat dataset with a template; sources with different templates are refused, naming them."""
    found: dict[str, str] = {}
    for s in cfg.sources:
        t = dataset_chat_template(s.path, s.name)
        if t is None:
            if require:
                raise ChatError(f"source {s.name!r} ({s.path}) is not a chat dataset (no chat template in its "
                                f"index.json); SFT trains on `fbt data prepare --format chat` output")
            continue
        found[s.name] = t
    if len(set(found.values())) > 1:
        raise ChatError(f"sources {sorted(found)} hold different chat templates; one run has one template")
    return next(iter(found.values()), None)
