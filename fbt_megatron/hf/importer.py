"""`fbt convert from-hf HF_DIR CHECKPOINT_DIR`: a Hugging Face directory -> a trainable checkpoint.

Two sources:
- our own exports (``model_type: fbt_llama``): every tensor, the feedback fusion included, comes back;
  the config's provenance and the tokenizer are kept in ``CHECKPOINT_DIR/hf_import/`` so that
  export -> import -> export reproduces the export bit for bit;
- a stock Llama-architecture checkpoint (``model_type`` llama, mistral or qwen2: ``families.py``): the stack and embeddings initialise an
  FBT model whose fusion (W_U, W_G, h_init) is freshly initialised. Latent feedback needs its own
  training phase (the paper: it cannot be switched on for a stock checkpoint), so the written recipe
  starts the feedback pass mix at step 0 (``fusion="off"`` imports a plain model instead).

The checkpoint is written by the trainer's own CheckpointManager (step 0, zero AdamW moments, which is
exactly a fresh AdamW), in the format every layout loads from (TP shards are cut on load), and
``CHECKPOINT_DIR/recipe.yaml`` continues training from it: ``fbt train CHECKPOINT_DIR/recipe.yaml``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import yaml

from data_pipeline.output_dir import OutputDirError, check_own_files
from fbt_megatron.checkpoint.discovery import IMPORT_DIR
from fbt_megatron.hf import families, mapping
from fbt_megatron.hf.export import HF_TOKENIZER_FILES
from fbt_megatron.hf.mapping import ConversionError

STOCK_TYPES = tuple(families.FAMILIES)
FEEDBACK_MIX = [0.75, 0.22, 0.03]
RECIPE_HEADER = "# Written by `fbt convert from-hf`"  # the first line of the recipe.yaml it writes


class HFTensors:
    """Tensors of an HF directory (one safetensors file or an index of shards), read one at a time."""

    def __init__(self, root: Path):
        self.root = root
        index = root / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConversionError(f"{index}: no 'weight_map' mapping of tensor names to files")
            self.files = {k: root / v for k, v in weight_map.items()}
        elif (root / "model.safetensors").is_file():
            with open_safetensors(root / "model.safetensors") as f:
                self.files = {k: root / "model.safetensors" for k in f.keys()}
        else:
            raise ConversionError(f"{root} has no model.safetensors or model.safetensors.index.json "
                                  "(only safetensors weights are read)")

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise ConversionError(f"{self.root}: tensor {name!r} is missing from the weights")
        file = self.files[name]
        if not file.is_file():
            raise ConversionError(f"{self.root}: weight shard {file.name} (holds {name!r}) is missing")
        with open_safetensors(file) as f:
            if name not in f.keys():
                raise ConversionError(f"{file}: tensor {name!r} is missing (the index says it is here)")
            return f.get_tensor(name).to(torch.float32)


def open_safetensors(file: Path):
    """``safe_open(file)``; a truncated or corrupt file is a :class:`ConversionError` naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), "pt")
    except SafetensorError as err:
        raise ConversionError(f"{file}: not a readable safetensors file ({err}); is it truncated? "
                              "download it again") from None


def read_json(file: Path) -> dict:
    """A JSON object from ``file``; bad JSON is a :class:`ConversionError` naming the file and line."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConversionError(f"{file}:{err.lineno}:{err.colno}: not valid JSON ({err.msg})") from None
    except UnicodeDecodeError as err:
        raise ConversionError(f"{file}: not UTF-8 text (byte {err.start})") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{file}: a JSON object was expected, not {type(data).__name__}")
    return data


def read_hf_config(root: Path) -> tuple[dict, bool]:
    """(config dict, is_stock)."""
    file = root / "config.json"
    if not file.is_file():
        raise ConversionError(f"{file} is missing: not a Hugging Face model directory")
    cfg = read_json(file)
    kind = cfg.get("model_type")
    if kind == "fbt_llama":
        return cfg, False
    if kind in STOCK_TYPES:
        return families.normalise(cfg, str(file)), True
    raise ConversionError(f"{file}: model_type={kind!r} cannot be imported; allowed: 'fbt_llama' (our exports) "
                          f"or {STOCK_TYPES} (the Llama architecture and its families)")


def build_recipe(cfg: dict, stock: bool, out: Path, fusion: str | None) -> dict:
    model, feedback = mapping.recipe_sections(cfg)
    prov = cfg.get("fbt") or {}
    if stock:
        feedback = {"fusion": fusion or "glu"}
        schedule = {"feedback_start_step": 0, "mix": FEEDBACK_MIX if feedback["fusion"] != "off" else [1.0]}
    else:
        if fusion is not None and fusion != feedback.get("fusion"):
            raise ConversionError(f"--fusion {fusion}: an FBT export keeps its own fusion "
                                  f"({feedback.get('fusion')!r})")
        schedule = dict(prov.get("schedule") or {"feedback_start_step": 0, "mix": FEEDBACK_MIX})
    seq = min(int(prov.get("seq_length", 0) or 0) or 512, model["max_sequence_length"])
    return {
        "name": out.name,
        "run_dir": str(out),
        "model": model,
        "feedback": feedback,
        "schedule": schedule,
        "parallel": {"tensor": 1, "zero_stage": 0},
        "batch": {"global_batch_size": 8, "micro_batch_size": 1},
        # Synthetic tokens keep the recipe runnable as written; train on real data tokenized with the
        # model's tokenizer (`fbt data prepare --tokenizer <out>/hf_import`) by setting data.source=pipeline.
        "data": {"source": "synthetic", "seq_length": seq, "synthetic": {"vocab_size": model["vocab_size"]}},
        "train": {"steps": 1000},
        # never a random model: without the imported checkpoint in run_dir the run is refused
        "checkpoint": {"every": 200, "resume": "required"},
    }


def _load_into_model(model, recipe, tensors: HFTensors, stock: bool) -> None:
    """Copy HF tensors into the freshly built TP=1 model through the mapping table (inverse)."""
    params = dict(model.named_parameters())
    for row in mapping.weight_rows(recipe.model, recipe.feedback):
        if stock and row.key.startswith("feedback."):
            continue  # the fusion of a stock model is freshly initialised
        for layer in (range(recipe.model.num_layers) if row.per_layer else [None]):
            name = row.param.format(i=layer)
            if name not in params:
                raise ConversionError(f"the model built from the recipe has no parameter {name!r} ({row.key})")
            param = params[name]
            hf_names = mapping.hf_names(row, layer)
            value = mapping.from_hf(row, [tensors.get(n) for n in hf_names], padded_vocab=param.shape[0])
            if tuple(value.shape) != tuple(param.shape):
                raise ConversionError(f"{tensors.root}: {hf_names} give shape {tuple(value.shape)} for {name!r}, "
                                      f"the model from config.json expects {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(value)
    if recipe.model.tie_embeddings and "lm_head.weight" in tensors.files:
        embed, head = tensors.get("model.embed_tokens.weight"), tensors.get("lm_head.weight")
        if not torch.equal(embed, head):
            raise ConversionError(f"{tensors.root}: tie_word_embeddings is set but lm_head.weight differs from "
                                  "model.embed_tokens.weight")


def import_hf(hf_dir: str | Path, out_dir: str | Path, *, fusion: str | None = None, log=print) -> Path:
    """Write ``out_dir/checkpoints/step_00000000`` + ``latest``, ``out_dir/recipe.yaml`` and
    ``out_dir/hf_import/``. Call inside a world-of-one process group. Returns the checkpoint path."""
    from fbt_megatron import runtime
    from fbt_megatron.hf.checkpoint_io import save_initial_checkpoint
    from fbt_megatron.model.fbt_gpt import build_model
    from fbt_megatron.recipe import RecipeError, load_recipe

    root, out = Path(hf_dir), Path(out_dir)
    try:  # OUT/recipe.yaml is written: a user's own recipe there is refused before anything is read
        check_own_files(out, {"recipe.yaml": lambda f: f.read_text().startswith(RECIPE_HEADER)},
                        writer="fbt convert from-hf", option="CHECKPOINT_DIR", instead="an empty CHECKPOINT_DIR")
    except OutputDirError as err:
        raise ConversionError(str(err)) from None
    cfg, stock = read_hf_config(root)
    tensors = HFTensors(root)
    recipe_data = build_recipe(cfg, stock, out, fusion)
    try:
        recipe = load_recipe(data=recipe_data)
    except RecipeError as err:
        raise ConversionError(f"{root / 'config.json'} gives an invalid recipe: {err}") from None
    if (out / "checkpoints" / "latest").exists():
        raise ConversionError(f"{out}/checkpoints already holds a checkpoint; choose an empty CHECKPOINT_DIR")

    runtime.init_parallel_state(runtime.ParallelLayout(), seed=recipe.seed)
    model = build_model(recipe.model, recipe.feedback)
    _load_into_model(model, recipe, tensors, stock)
    path = save_initial_checkpoint(out, model, recipe)

    keep = out / IMPORT_DIR
    keep.mkdir(parents=True, exist_ok=True)
    for name in HF_TOKENIZER_FILES + ("tokenizer.model",):
        if (root / name).is_file():
            shutil.copyfile(root / name, keep / name)
    prov = cfg.get("fbt") if not stock else {"recipe_name": f"{root.name} (stock {cfg.get('model_type')})",
                                              "source_model_type": cfg.get("model_type"),
                                              "steps": 0, "tokens_seen": 0, "pass_counts": {},
                                              "schedule": recipe.schedule.model_dump(mode="json")}
    (keep / "provenance.json").write_text(json.dumps(prov or {}, indent=1, sort_keys=True))
    header = (RECIPE_HEADER + ". Continue with: fbt train {}\n".format(out / "recipe.yaml")
              + ("# Latent feedback was freshly initialised: it needs this dedicated feedback phase (the pass\n"
                 "# mix runs from step 0); it cannot be switched on for a stock checkpoint without training.\n"
                 if stock and recipe.feedback.fusion != "off" else "")
              + "# data: synthetic tokens as written; for real training set data.source=pipeline with shards\n"
              + "# tokenized by the model's tokenizer: `fbt data prepare --tokenizer {}`.\n".format(out / IMPORT_DIR))
    (out / "recipe.yaml").write_text(header + yaml.safe_dump(recipe_data, sort_keys=False))
    log(f"imported {root} ({'stock ' + cfg['model_type'] if stock else 'FBT export'}) -> {path}")
    return path
