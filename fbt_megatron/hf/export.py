"""`fbt convert to-hf CHECKPOINT OUT_DIR`: a checkpoint (any TP / PP / ZeRO layout) -> a Hugging Face
directory that ``AutoModelForCausalLM.from_pretrained(OUT_DIR, trust_remote_code=True)`` loads.

``--standard`` writes a plain Llama checkpoint instead (``model_type: llama``, no remote code, no
fusion weights): the FBT model's standard decoding, which its first pass is, for any Llama server.
Only a Llama-class recipe whose first pass reads token embeddings converts (``mapping.check_llama_class``).

Streaming: the tensors are read one transformer layer at a time (``checkpoint_io``), converted by the
table in ``mapping.py`` and appended to the current safetensors shard, which is written and dropped as
soon as it is full. Shards are planned from the checkpoint's metadata before any tensor is read, so
names (``model-00001-of-00003.safetensors``) and the index are known up front; peak memory is about
one layer's tensors plus one shard (``max_shard_bytes``).

Atomic: the inputs (checkpoint, recipe, tokenizer) are checked before anything is written, the
directory is built as ``.OUT_DIR.partial-PID`` next to ``OUT_DIR`` and renamed to ``OUT_DIR`` at the end;
a failure removes it, so a failed export leaves no directory that looks complete. An existing
non-empty ``OUT_DIR`` is refused (nothing is overwritten).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from data_pipeline.output_dir import describe
from data_pipeline.tokenizer import HF_TOKENIZER_FILES  # noqa: F401 (the importer's list too)
from fbt_megatron.checkpoint.discovery import CheckpointError, import_dir, run_tokenizer
from fbt_megatron.files import new_file_mode
from fbt_megatron.hf import families, mapping
from fbt_megatron.hf.checkpoint_io import CheckpointTensors, resolve_checkpoint
from fbt_megatron.hf.mapping import ConversionError
from fbt_megatron.model import feedback_rule

# The model's folder holds the HF model (modeling_fbt.py, remote code) beside the rule it imports.
MODELING_FILE = Path(feedback_rule.__file__).with_name("modeling_fbt.py")
# The remote code every FBT export ships: the modelling file and the feedback rule it imports as a sibling.
REMOTE_CODE = (MODELING_FILE, Path(feedback_rule.__file__))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DEFAULT_SHARD_BYTES = 2 * 1024**3


def _recipe(state: dict):
    from fbt_megatron.recipe import load_saved_recipe

    if "recipe" not in state:
        raise ConversionError("the checkpoint's state.json has no 'recipe': cannot tell the model's shape")
    return load_saved_recipe(state["recipe"])


# ---------------------------------------------------------------------- provenance
def provenance(path: Path, state: dict, recipe) -> dict:
    """Recipe name, steps, tokens seen and pass mix; an imported model's own history is added to its
    source's (so export -> import -> export reproduces the source's card and config)."""
    ts = state.get("train_state", {})
    own = {"steps": int(ts.get("step", 0)), "tokens_seen": int(ts.get("tokens_seen", 0)),
           "pass_counts": {str(k): int(v) for k, v in ts.get("pass_counts", {}).items()}}
    src_file = import_dir(path) / "provenance.json"
    if src_file.is_file():
        src = json.loads(src_file.read_text())
        counts = dict(src.get("pass_counts", {}))
        for k, v in own["pass_counts"].items():
            counts[k] = counts.get(k, 0) + v
        out = dict(src, steps=src.get("steps", 0) + own["steps"],
                   tokens_seen=src.get("tokens_seen", 0) + own["tokens_seen"], pass_counts=counts)
        if own["steps"]:
            out["continued_as"] = recipe.name
        return out
    return {"recipe_name": recipe.name, **own, "schedule": recipe.schedule.model_dump(mode="json"),
            "seq_length": recipe.data.seq_length}


# ---------------------------------------------------------------------- tokenizer
def tokenizer_source(path: Path, recipe) -> tuple[str, Path] | None:
    """("hf", dir) or ("sp", model) for the run's tokenizer (:func:`checkpoint.discovery.run_tokenizer`: the
    checkpoint's copy, an import's, or the recipe's path), or None (synthetic data: no tokenizer)."""
    try:
        found = run_tokenizer(path, None if recipe is None else {"data": recipe.data.model_dump()})
    except CheckpointError as err:
        raise ConversionError(str(err)) from None
    return None if found is None else given_tokenizer(found)


def given_tokenizer(tokenizer: str | Path) -> tuple[str, Path]:
    """``--tokenizer PATH``: a sentencepiece model file, a ``tokenizer.json`` or a directory of either,
    checked before anything is written."""
    from data_pipeline.errors import TokenizerMismatchError
    from data_pipeline.tokenizer import tokenizer_files

    try:
        files = tokenizer_files(tokenizer)
    except TokenizerMismatchError as err:
        raise ConversionError(f"--tokenizer {tokenizer}: {err} (a sentencepiece .model, a tokenizer.json or a "
                              "directory holding one is expected)") from None
    return ("hf", Path(tokenizer)) if "tokenizer.json" in files else ("sp", files["tokenizer.model"])


def write_tokenizer(source: tuple[str, Path] | None, out: Path, vocab_size: int | None = None,
                    max_length: int | None = None) -> dict:
    """Tokenizer files of a stock class (no remote code of its own; transformers 5's ``AutoTokenizer``
    still asks about the model's remote-code config without ``trust_remote_code``, docs/hf.md); returns
    the special token ids for the config. The tokenizer gets a pad token (the source's, else EOS) and
    pads on the left (for batched generation), and ``model_max_length`` is ``max_length`` (the recipe's
    sequence length)."""
    if source is None:
        return {}
    kind, where = source
    eos = None
    if kind == "hf":
        from data_pipeline.tokenizer import load_tokenizer, tokenizer_files

        files = tokenizer_files(where)  # tokenizer.json (+ its config files), copied unchanged
        if where.is_dir() and (where / "tokenizer.model").is_file():
            files["tokenizer.model"] = where / "tokenizer.model"
        for name, file in files.items():
            shutil.copyfile(file, out / name)
        hf = load_tokenizer(where)  # the data pipeline's EOS: the one the run was trained to end documents with
        eos = hf.id_to_piece(hf.eos_id())
    else:
        _convert_sentencepiece(where, out)
    from transformers import PreTrainedTokenizerFast

    if eos is not None:
        _finish_tokenizer_config(out, None, max_length, eos=eos)  # a bare tokenizer.json names no EOS
    tok = PreTrainedTokenizerFast.from_pretrained(str(out))  # (AutoTokenizer would read config.json)
    if vocab_size is not None and len(tok) > vocab_size:
        raise ConversionError(f"tokenizer {where} has {len(tok)} tokens, more than the model's vocab_size="
                              f"{vocab_size}")
    pad = tok.pad_token or tok.eos_token or tok.unk_token
    _finish_tokenizer_config(out, pad, max_length)
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.convert_tokens_to_ids(pad) if pad is not None else None}


def _finish_tokenizer_config(out: Path, pad: str | None, max_length: int | None, eos: str | None = None) -> None:
    """A stock class every transformers in the supported range has (``PreTrainedTokenizerFast``: it loads
    tokenizer.json as written, so the ids stay the sentencepiece model's; transformers 5 writes its own
    ``TokenizersBackend``, which 4.x lacks and which sends ``AutoTokenizer`` to the remote code), a pad
    token, left padding, ``model_max_length``; machine-local loading flags dropped."""
    cfg_file = out / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}  # an import may have tokenizer.json only
    for key in ("is_local", "local_files_only", "backend"):
        cfg.pop(key, None)
    if cfg.get("tokenizer_class") in (None, "TokenizersBackend"):
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = cfg.get("extra_special_tokens")
    if isinstance(extra, list):  # 5.x lists the named special tokens again; 4.x expects a dict here
        named = {cfg.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        extra = [t for t in extra if t not in named]
        if extra:
            cfg["additional_special_tokens"] = extra
        cfg.pop("extra_special_tokens")
    if eos is not None and not cfg.get("eos_token"):
        cfg["eos_token"] = eos
    if pad is not None:
        cfg["pad_token"] = pad
    cfg["padding_side"] = "left"
    if max_length:
        cfg["model_max_length"] = int(max_length)
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _convert_sentencepiece(model: Path, out: Path) -> None:
    """The fast tokenizer the data pipeline's chat code uses (``data_pipeline.chat``), saved with the .model."""
    from data_pipeline.chat import sentencepiece_fast_tokenizer

    sentencepiece_fast_tokenizer(model.read_bytes()).save_pretrained(str(out))
    shutil.copyfile(model, out / "tokenizer.model")


# ---------------------------------------------------------------------- config
def standard_hf_config(recipe, prov: dict, tokens: dict, dtype: str) -> dict:
    """transformers' own config fields for the model without its fusion, as its family (Llama; Qwen2 for
    q/k/v-only biases; Mistral when imported from one: ``families.standard_family``)."""
    fields = mapping.hf_config_fields(recipe.model, recipe.feedback)
    for name in mapping.FBT_ONLY_FIELDS:
        fields.pop(name)
    family = families.standard_family(recipe.model, prov.get("source_model_type"))
    if family.implied:  # the family's modelling code fixes these (Qwen2: q/k/v biases, none elsewhere)
        fields = {k: v for k, v in fields.items() if k not in ("attention_bias", "mlp_bias")}
    return {"architectures": [family.architecture], "model_type": family.model_type, **fields,
            **family.standard_fields, "use_cache": True,
            "dtype": DTYPE_NAMES[dtype], "torch_dtype": DTYPE_NAMES[dtype],  # (4.x reads torch_dtype)
            "bos_token_id": tokens.get("bos_token_id"), "eos_token_id": tokens.get("eos_token_id"),
            "pad_token_id": tokens.get("pad_token_id"), "fbt": dict(prov, exported_as="standard")}


def hf_config(recipe, prov: dict, tokens: dict, dtype: str) -> dict:
    fields = mapping.hf_config_fields(recipe.model, recipe.feedback)
    from fbt_megatron.passes import PassSchedule

    deepest = PassSchedule.of(recipe.schedule, recipe.feedback).max_passes  # trained
    cfg = {
        "architectures": ["FBTForCausalLM"],
        # AutoModel: the bare stack, which refuses vLLM's Transformers backend naming the vLLM plugin
        "auto_map": {"AutoConfig": "modeling_fbt.FBTConfig", "AutoModel": "modeling_fbt.FBTModel",
                     "AutoModelForCausalLM": "modeling_fbt.FBTForCausalLM"},
        "model_type": "fbt_llama",
        **fields,
        "forward_passes": deepest,
        "feedback_decoding": "feedback",
        "prefill_passes": 2,  # the paper's FUSED prefill, as `fbt generate` defaults to
        "use_cache": True,
        "dtype": DTYPE_NAMES[dtype],
        "torch_dtype": DTYPE_NAMES[dtype],  # the name transformers 4.x reads
        "bos_token_id": tokens.get("bos_token_id"),
        "eos_token_id": tokens.get("eos_token_id"),
        "pad_token_id": tokens.get("pad_token_id"),
        "fbt": prov,
    }
    return cfg


# ---------------------------------------------------------------------- weights
def plan_shards(entries: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    shards, current, size = [], [], 0
    for name, nbytes in entries:
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def _out_shapes(row: mapping.Row, stored: tuple) -> list[tuple]:
    """The HF tensors' shapes for a row, from its stored global shape (no data read)."""
    shape = stored[1:] if row.per_layer else stored
    return [tuple(t.shape) for t in mapping.to_hf(row, torch.empty(shape, device="meta"))]


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, dtype: str = "fp32",
                      max_shard_bytes: int = DEFAULT_SHARD_BYTES, tokenizer: str | Path | None = None,
                      standard: bool = False, log=print, progress: bool | None = None) -> Path:
    """Write the HF directory; returns it. Call inside a (world-of-one) process group. ``standard``:
    a plain Llama checkpoint (see the module docstring). ``progress``: a bar over the weight bytes
    written (stderr; None = only on a terminal). Atomic (see the module docstring)."""
    if dtype not in DTYPES:
        raise ConversionError(f"dtype={dtype!r} is not one of {tuple(DTYPES)}")
    from fbt_megatron.checkpoint import read_checkpoint_state
    from fbt_megatron.checkpoint.discovery import check_given_tokenizer

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):  # never written over (data_pipeline.output_dir)
        held = f" (it holds {describe(sorted(e.name for e in out.iterdir()))})" if out.is_dir() else ""
        raise ConversionError(f"{out} already exists and is not an empty directory{held}; choose a new OUT_DIR "
                              "(nothing is overwritten)")
    path = resolve_checkpoint(checkpoint)
    state = read_checkpoint_state(path)
    recipe = _recipe(state)
    if standard:
        mapping.check_llama_class(recipe.model, recipe.feedback)
    if tokenizer:
        check_given_tokenizer(path, tokenizer)
    tok_source = given_tokenizer(tokenizer) if tokenizer else tokenizer_source(path, recipe)
    rows = mapping.weight_rows(recipe.model, recipe.feedback)
    reader = CheckpointTensors(path)
    reader.verify(rows, recipe.model.num_layers)
    if standard:  # the plain model: the fusion's weights stay behind
        rows = [r for r in rows if not r.key.startswith("feedback.")]

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        summary = _write_export(path, state, recipe, rows, reader, partial, dtype=dtype,
                                max_shard_bytes=max_shard_bytes, tok_source=tok_source, standard=standard,
                                progress=progress, label=out.name)
        if out.is_dir():
            out.rmdir()  # empty (checked above)
        os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    log(f"exported {path} -> {out} ({summary})")
    return out


BOUND_MARGIN = 2.0 ** -20  # ~8 float32 ulps of 1: beyond the rounding of any sigma estimate of the exported W_U


def as_applied(key: str, tensor: torch.Tensor, feedback) -> torch.Tensor:
    """A stored weight as the model applies it: under ``feedback.mixin: bounded`` W_U divided by
    max(1, its spectral norm) (model/feedback.py), so the exported model computes the trained one."""
    if key == "feedback.value.weight" and feedback.mixin == "bounded":
        sigma = feedback_rule.spectral_norm(tensor)
        if sigma <= 1:
            return tensor
        # a hair inside the unit ball: a re-import applies the bound again, which must leave it bit for bit
        # (divided by sigma exactly, rounding leaves sigma a few ulps either side of 1). Exact for fp32
        # exports; a bf16/fp16 export rounds after this, and its re-import moves W_U by ~1e-5 relative.
        return feedback_rule.bounded(tensor, sigma / (1.0 - BOUND_MARGIN))
    return tensor


def _write_export(path: Path, state: dict, recipe, rows, reader: CheckpointTensors, out: Path, *, dtype: str,
                  max_shard_bytes: int, tok_source, standard: bool, progress: bool | None, label: str) -> str:
    """Every file of the export into ``out``; returns a one-line summary."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    # The tokenizer first: its checks (vocabulary size, conversion) fail before any weight is written.
    tokens = write_tokenizer(tok_source, out, recipe.model.vocab_size, max_length=recipe.data.seq_length)
    from fbt_megatron.generate.chat import export_chat_template

    export_chat_template(path, out)  # an SFT run's chat template: tokenizer.apply_chat_template works
    num_layers = recipe.model.num_layers
    # Units of reading: each non-layer row alone, then every layer's rows together.
    units = [[(r, None)] for r in rows if not r.per_layer and r.key.startswith("gpt.embedding")]
    units += [[(r, i) for r in rows if r.per_layer] for i in range(num_layers)]
    units += [[(r, None)] for r in rows if not r.per_layer and not r.key.startswith("gpt.embedding")]
    elem = torch.empty((), dtype=DTYPES[dtype]).element_size()
    entries = []
    for unit in units:
        for row, layer in unit:
            for name, shape in zip(mapping.hf_names(row, layer), _out_shapes(row, reader.shapes[row.key])):
                entries.append((name, elem * int(torch.Size(shape).numel())))
    nbytes = dict(entries)
    shards = plan_shards(entries, max_shard_bytes)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors" for n in range(len(shards))])
    shard_of = {name: n for n, names in enumerate(shards) for name in names}

    bar = tqdm(total=sum(nbytes.values()), unit="B", unit_scale=True, desc=f"to-hf {label}", disable=None if progress is None else not progress, file=sys.stderr)
    pending: dict[str, torch.Tensor] = {}
    next_shard = 0
    with bar:
        for unit in units:
            for (row, layer), tensor in zip(unit, reader.read(unit, num_layers)):
                tensor = as_applied(row.key, tensor, recipe.feedback)
                for name, t in zip(mapping.hf_names(row, layer), mapping.to_hf(row, tensor)):
                    pending[name] = t.to(DTYPES[dtype]).contiguous().clone()  # own storage: no views into `tensor`
            while next_shard < len(shards) and all(n in pending for n in shards[next_shard]):
                save_file({n: pending.pop(n) for n in shards[next_shard]}, str(out / files[next_shard]),
                          metadata={"format": "pt"})
                os.chmod(out / files[next_shard], new_file_mode())  # readable as config.json is: safetensors#782
                bar.update(sum(nbytes[n] for n in shards[next_shard]))
                next_shard += 1
    if next_shard != len(shards) or pending:
        raise RuntimeError(f"export wrote {next_shard} of {len(shards)} shards ({len(pending)} tensors left)")
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(b for _, b in entries)},
                 "weight_map": {name: files[shard_of[name]] for name, _ in entries}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    prov = provenance(path, state, recipe)
    config = (standard_hf_config if standard else hf_config)(recipe, prov, tokens, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {"bos_token_id": tokens.get("bos_token_id"), "eos_token_id": tokens.get("eos_token_id"),
                  "pad_token_id": tokens.get("pad_token_id"), "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    if not standard:
        for file in REMOTE_CODE:
            shutil.copyfile(file, out / file.name)
    from fbt_megatron.hf.model_card import model_card

    (out / "README.md").write_text(model_card(config, has_tokenizer=tok_source is not None))
    return f"{len(entries)} tensors in {len(shards)} shard(s), {dtype}"
