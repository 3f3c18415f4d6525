"""``fbt data ...``: tokenizer, prepare, embedded, inspect, peek."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

import yaml

from .argtypes import number
from .errors import DataError


COUNT = number(int, ge=1)  # workers, sizes, counts: at least one
INDEX = number(int, ge=0)  # a task, a start position, a seed
MEGABYTES = number(float, gt=0)


def _cmd_tokenizer(a) -> int:
    from .tokenizer import load_tokenizer, tokenizer_files, tokenizer_hash, train_tokenizer

    out = Path(a.out)
    if a.load:
        load_tokenizer(a.load)  # validates
        if Path(a.load).resolve() != out.resolve():
            if Path(a.load).is_dir():  # a Hugging Face model directory: its tokenizer files into OUT/
                out.mkdir(parents=True, exist_ok=True)
                for name, file in tokenizer_files(a.load).items():
                    shutil.copyfile(file, out / name)
            else:
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(a.load, out)
        h = tokenizer_hash(out)
    else:
        if not a.input:
            raise DataError("fbt data tokenizer: give --input PATH... to train, or --load MODEL")
        from .sources import iter_documents

        counts: dict = {}
        texts = (t for _, t in iter_documents(a.input, text_field=a.text_field, counts=counts))
        h = train_tokenizer(texts, out, vocab_size=a.vocab_size, model_type=a.model_type,
                            max_sentences=a.max_sentences)
    sp = load_tokenizer(out)
    print(json.dumps({"tokenizer": str(out), "hash": h, "vocab_size": sp.vocab_size(), "eos_id": sp.eos_id(),
                      "bos_id": sp.bos_id(), "bos_added_by_tokenizer": getattr(sp, "added_bos", lambda: None)()}))
    return 0


def _cmd_prepare(a) -> int:
    from .prepare import prepare_dataset

    if a.format == "chat":
        return _prepare_chat(a)
    if a.chat_template or a.strict or a.max_tokens is not None:
        raise DataError("--chat-template, --strict and --max-tokens apply to --format chat")
    idx = prepare_dataset(a.input, a.out, a.tokenizer, name=a.name, shard_bytes=int(a.shard_mb * (1 << 20)),
                          num_workers=a.workers, text_field=a.text_field, id_field=a.id_field or None,
                          progress=not a.quiet, skip_bad_rows=a.skip_bad_rows, bos=a.bos, overwrite=a.overwrite)
    print(json.dumps({k: idx[k] for k in ("name", "num_samples", "num_tokens", "skipped_empty_documents",
                                           "skipped_bad_rows", "bos_added_id",
                                           "tokenizer_hash", "seconds", "prepare")} | {"shards": idx["num_shards"]}))
    return 0


def _prepare_chat(a) -> int:
    if a.bos != "no":
        raise DataError("--bos applies to text data (chat: the chat template writes any BOS)")
    if a.skip_bad_rows:
        raise DataError("--skip-bad-rows applies to text data (chat: bad conversations are counted skips unless --strict)")
    from .chat import prepare_chat

    template = None
    if a.chat_template:
        path = Path(a.chat_template)
        if not path.is_file():
            raise DataError(f"--chat-template {path}: no such file (a Jinja chat template is expected)")
        template = path.read_text()
    idx = prepare_chat(a.input, a.out, a.tokenizer, chat_template=template, max_tokens=a.max_tokens or 2048,
                       strict=a.strict, name=a.name, shard_bytes=int(a.shard_mb * (1 << 20)),
                       num_workers=a.workers, progress=not a.quiet, overwrite=a.overwrite)
    bad = idx["meta"]["bad_rows"]
    print(json.dumps({k: idx[k] for k in ("name", "num_samples", "num_tokens", "tokenizer_hash", "seconds")}
                     | {"format": "chat", "shards": idx["num_shards"], "bad_rows": bad["counts"],
                        "first_bad_row": bad["first"], "chat_template_sha": idx["meta"]["chat_template_sha"]}))
    return 0


def _cmd_prepare_task(a) -> int:
    import os

    from . import array

    task = a.task
    if task is None and a.stage != "merge":
        raw = os.environ.get("SLURM_ARRAY_TASK_ID")
        if raw is None:
            raise DataError(f"prepare-task {a.stage}: give --task I (or run as a SLURM array task: SLURM_ARRAY_TASK_ID)")
        task = int(raw)
    if a.stage == "count":
        rec = array.count_slice(a.plan, task)
        print(json.dumps({"stage": "count", "task": task, "shards": len(rec["shard_docs"]),
                          "num_samples": rec["num_samples"]}))
    elif a.stage == "tokenize":
        rec = array.tokenize_slice(a.plan, task, num_workers=a.workers)
        print(json.dumps({"stage": "tokenize", "task": task, "shards": len(rec["infos"]), "tokens": rec["tokens"],
                          "kept_shards": rec["kept_shards"], "seconds": rec["seconds"],
                          "tokens_per_s": rec["tokens_per_s"], "workers": rec["workers"]}))
    else:
        idx = array.merge(a.plan)
        print(json.dumps({"stage": "merge", "out": array.load_plan(a.plan)["out"], "num_samples": idx["num_samples"],
                          "num_tokens": idx["num_tokens"], "shards": idx["num_shards"],
                          "skipped_bad_rows": idx["skipped_bad_rows"], "prepare": idx["prepare"]}))
    return 0


def _cmd_embedded(a) -> int:
    from .embedded import build_embedded, settle_mix_seq_length

    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    data = build_embedded(a.out, vocab_size=a.vocab_size, code_mb=a.code_mb, prose_mb=a.prose_mb,
                          math_docs=a.math_docs, seed=a.seed, num_workers=a.workers,
                          seq_length=a.seq_length or 256, force=a.force, progress=not a.quiet, log=log)
    in_file = settle_mix_seq_length(a.out, a.seq_length, log=log)  # asked: the file says it too; else its own
    if in_file is not None:
        data["seq_length"] = in_file
    print(yaml.safe_dump({"data": data}, sort_keys=False), end="")
    return 0


def _cmd_inspect(a) -> int:
    from .shards import Dataset, verify_dataset

    for p in a.dirs:
        ds = Dataset.load(p)
        i = ds.index
        info = {"path": str(p), "name": i["name"], "format_version": ds.version, "samples": i["num_samples"],
                "tokens": i["num_tokens"], "shards": ds.num_shards, "tokenizer_hash": i["tokenizer_hash"],
                "skipped_empty_documents": i["skipped_empty_documents"],
                "mean_doc_tokens": round(i["num_tokens"] / max(1, i["num_samples"]), 1)}
        if a.verify:
            info["verified"] = verify_dataset(p)
        print(json.dumps(info))
    return 0


def _peek_config(path: Path):
    """The stream's DataConfig from a mix.yaml (``data:`` a DataConfig) or a training recipe (its
    ``data.pipeline``, or the embedded mix it builds); a file that is neither is one sentence."""
    from pydantic import ValidationError

    from .config import DataConfig

    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise DataError(f"{path} is not YAML{at}: give a mix.yaml or a recipe") from None
    data = raw.get("data", raw) if isinstance(raw, dict) else None
    if isinstance(data, dict) and ("source" in data or "pipeline" in data):  # a training recipe's data section
        if data.get("source", "synthetic") == "synthetic":
            raise DataError(f"{path} trains on synthetic data (data.source: synthetic): there is no stream to peek")
        # as fbt train reads it: the row length and the data order's seed are the recipe's
        own = {"seq_length": data.get("seq_length", 64), **({"seed": data["seed"]} if data.get("seed") is not None
                                                             else {})}
        if data.get("pipeline") is None:  # the embedded mix, as fbt train builds it
            where = Path(data.get("embedded_dir") or "data/embedded")
            if not (where / "mix.yaml").is_file():
                raise DataError(f"{path} reads the embedded mix, which is not built at {where} (relative to this "
                                f"directory): run fbt data embedded --out {where}")
            return _peek_config(where / "mix.yaml").model_copy(update=own)
        data = {**data["pipeline"], **own}
    if not isinstance(data, dict):
        raise DataError(f"{path} is neither a mix.yaml nor a recipe: it holds no data mapping")
    try:
        cfg = DataConfig(**data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise DataError(f"{path} is neither a mix.yaml nor a recipe with data.pipeline: {where}: {first['msg']}") from None
    named = Path(cfg.tokenizer)
    if (path.parent / "embedded.json").is_file() and named.is_absolute() and not named.exists() \
            and named.parent.resolve() != path.parent.resolve():  # a copied or moved embedded build
        raise DataError(f"{path} names the files of the embedded build at {named.parent}, which are not there: "
                        f"run fbt data embedded --out {path.parent} to point it at this build's own")
    return cfg


def _cmd_peek(a) -> int:
    from .loader import build_loader
    from .tokenizer import load_tokenizer

    cfg = _peek_config(Path(a.recipe))
    sp = load_tokenizer(cfg.tokenizer)
    loader = build_loader(cfg, micro_batch_size=1, global_batch_size=1, dp_rank=0, dp_size=1,
                          consumed_sequences=a.start, split=a.split)
    for n in range(a.sequences):
        b = next(loader)
        ids = b["input_ids"][0].tolist()
        starts = b["doc_start"][0].nonzero().flatten().tolist()
        print(f"--- {a.split} sequence {a.start + n} (document starts at {starts})")
        print(sp.decode(ids))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fbt data", description="Tokenizer, WebDataset shards and the token mix")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("tokenizer", help="train a sentencepiece model from text sources, or load one (also a "
                                         "Hugging Face tokenizer.json or model directory: --load DIR --out DIR)")
    t.add_argument("--input", nargs="*", default=[], help="JSONL files, text files or directories")
    t.add_argument("--load", help="an existing .model to validate (and copy to --out)")
    t.add_argument("--out", required=True, help="output .model path")
    t.add_argument("--vocab-size", type=COUNT, default=4096)
    t.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    t.add_argument("--max-sentences", type=COUNT, default=300_000)
    t.add_argument("--text-field", default="text")
    t.set_defaults(fn=_cmd_tokenizer)

    q = sub.add_parser("prepare", help="tokenize sources into WebDataset shards with an index "
                                       "(parallel; run the same command again to resume after a crash)")
    q.add_argument("--input", nargs="+", required=True,
                   help="JSONL (.jsonl, .jsonl.gz, .jsonl.zst), Parquet, a datasets save directory, text files or "
                        "directories of them")
    q.add_argument("--tokenizer", required=True,
                   help="a sentencepiece .model, a Hugging Face tokenizer.json, or a model directory holding either")
    q.add_argument("--out", required=True, help="dataset directory to write")
    q.add_argument("--name", help="source name (default: the output directory's name)")
    q.add_argument("--shard-mb", type=MEGABYTES, default=16.0,
                   help="about this many MB per shard (estimated from the text; shards are the unit of parallel work)")
    q.add_argument("--workers", type=COUNT, default=2, help="tokenizer/shard-writer processes")
    q.add_argument("--text-field", default="text", help="the text field (JSONL) or column (Parquet, Arrow)")
    q.add_argument("--id-field", default="id")
    q.add_argument("--skip-bad-rows", action="store_true",
                   help="skip and count rows that are not valid JSON/UTF-8 or lack a string text (default: an error "
                        "naming file and row); a corrupt file or a missing column is always an error")
    q.add_argument("--bos", choices=("no", "yes", "auto"), default="no",
                   help="a BOS token before each document: no (default), yes (the tokenizer's BOS), auto (what the "
                        "tokenizer's own post-processor adds: Llama 3, Llama 2 and Mistral tokenizer.json a BOS, "
                        "Qwen2 none; a sentencepiece model none); recorded as bos_added_id in index.json")
    q.add_argument("--overwrite", action="store_true",
                   help="replace a dataset of other inputs or settings at --out (a directory holding anything but "
                        "a dataset is never replaced; the same dataset is kept as it is)")
    q.add_argument("--quiet", action="store_true")
    q.add_argument("--format", choices=("text", "chat"), default="text",
                   help="text: documents (--text-field); chat: JSONL {\"messages\": [{\"role\", \"content\"}, ...]} "
                        "with a per-token loss mask on the assistant turns (docs/data.md)")
    q.add_argument("--chat-template", help="chat: a Jinja template file (default: the built-in one; assistant "
                                           "turns inside {%% generation %%} ... {%% endgeneration %%})")
    q.add_argument("--max-tokens", type=COUNT, default=None,
                   help="chat: longer conversations are bad rows (default 2048; use the recipe's seq_length)")
    q.add_argument("--strict", action="store_true", help="chat: a bad conversation is an error, not a counted skip")
    q.set_defaults(fn=_cmd_prepare)

    r = sub.add_parser("prepare-task", help="one stage of a job-array prepare (`fbt slurm submit-prepare` runs "
                                            "them; data_pipeline/array.py)")
    r.add_argument("stage", choices=("count", "tokenize", "merge"))
    r.add_argument("--plan", required=True, help="the array directory <out>.array holding plan.json")
    r.add_argument("--task", type=INDEX, default=None, help="the slice (default: $SLURM_ARRAY_TASK_ID)")
    r.add_argument("--workers", type=COUNT, default=1, help="tokenize: tokenizer/shard-writer processes")
    r.set_defaults(fn=_cmd_prepare_task)

    e = sub.add_parser("embedded", help="build the embedded default mix offline (stdlib code, docs, math)")
    e.add_argument("--out", default="data/embedded")
    e.add_argument("--vocab-size", type=COUNT, default=4096)
    e.add_argument("--code-mb", type=MEGABYTES, default=6.0)
    e.add_argument("--prose-mb", type=MEGABYTES, default=3.0)
    e.add_argument("--math-docs", type=COUNT, default=20_000)
    e.add_argument("--seed", type=INDEX, default=0)
    e.add_argument("--seq-length", type=COUNT, default=None,
                   help="mix.yaml's seq_length (default: an earlier build's, else 256)")
    e.add_argument("--workers", type=COUNT, default=None)
    e.add_argument("--force", action="store_true", help="rebuild from this Python's standard library even if an earlier build has the same settings")
    e.add_argument("--quiet", action="store_true")
    e.set_defaults(fn=_cmd_embedded)

    i = sub.add_parser("inspect", help="summarise dataset directories (optionally read and verify every sample)")
    i.add_argument("dirs", nargs="+")
    i.add_argument("--verify", action="store_true")
    i.set_defaults(fn=_cmd_inspect)

    k = sub.add_parser("peek", help="decode the first sequences of the stream of a recipe/mix.yaml")
    k.add_argument("recipe")
    k.add_argument("--sequences", type=COUNT, default=2)
    k.add_argument("--start", type=INDEX, default=0)
    k.add_argument("--split", choices=("train", "valid"), default="train",
                   help="train (default) or the held-out valid split (valid_documents)")
    k.set_defaults(fn=_cmd_peek)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except DataError as exn:
        print(f"error: {exn}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
