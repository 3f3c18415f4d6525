"""A small chat dataset for the SFT tests: arithmetic conversations, a tokenizer trained on them."""

from __future__ import annotations

import json
import random
from pathlib import Path


def conversation(rng: random.Random, i: int) -> dict:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    msgs = []
    if i % 3 == 0:
        msgs.append({"role": "system", "content": "Be brief."})
    msgs.append({"role": "user", "content": f"{a}+{b}?"})
    msgs.append({"role": "assistant", "content": f"{a + b}"})
    if i % 4 == 0:
        msgs += [{"role": "user", "content": "and x2?"}, {"role": "assistant", "content": f"{2 * (a + b)}"}]
    return {"messages": msgs}


def build_chat_fixture(root, n: int = 160, vocab_size: int = 512, seed: int = 0) -> dict:
    """``root/chat.jsonl`` (n conversations), ``root/tok.model``, the chat dataset ``root/chat`` and a
    plain-text dataset ``root/text`` (for a pretraining run to start SFT from)."""
    from data_pipeline.chat import DEFAULT_CHAT_TEMPLATE, prepare_chat
    from data_pipeline.prepare import prepare_dataset
    from data_pipeline.tokenizer import train_tokenizer
    from tests.support.data_fixtures import write_corpus

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    convs = [conversation(rng, i) for i in range(n)]
    (root / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    docs = write_corpus(root / "raw", seed)
    texts = [t for v in docs.values() for _, t in v]
    rendered = ["".join(f"<|{m['role']}|>\n{m['content']}" for m in c["messages"]) for c in convs]
    tok = root / "tok.model"
    train_tokenizer(texts + rendered, tok, vocab_size=vocab_size, num_threads=1)
    prepare_chat([str(root / "chat.jsonl")], root / "chat", tok, max_tokens=96, progress=False)
    prepare_dataset([str(root / "raw" / "web.jsonl")], root / "text", tok, name="text", progress=False)
    return {"root": root, "tokenizer": str(tok), "conversations": convs, "template": DEFAULT_CHAT_TEMPLATE}


def chat_data_section(fx: dict, seq_length: int = 32, name: str = "chat") -> dict:
    return {"sources": [{"name": name, "path": str(fx["root"] / name), "weight": 1.0}],
            "tokenizer": fx["tokenizer"], "seq_length": seq_length}


def sft_recipe(run_dir, fx: dict, init_from=None, **sections) -> dict:
    """The tests' tiny recipe on the chat dataset with ``task: sft`` (model vocabulary: the fixture's)."""
    from tests.support.training import tiny_recipe

    sections.setdefault("model", {})
    sections["model"] = {"vocab_size": 512, "max_sequence_length": 64, **sections["model"]}
    r = tiny_recipe(run_dir, data={"source": "pipeline", "pipeline": chat_data_section(fx)}, task="sft", **sections)
    if init_from is not None:
        r["init_from"] = str(init_from)
    return r


def sft_train_fn(recipe_data: dict, probe: str | None = None) -> dict:
    """``fbt sft``'s path in a (distributed) test process: the recipe resolved against ``init_from``
    (its model section when the recipe has none) and checked, then trained; returns the summary."""
    from tests.support.training import train_fn

    return train_fn(recipe_data, probe=probe, task="sft")


def stock_llama(path, vocab_size: int = 512):
    """A small random LlamaForCausalLM saved by transformers (an "HF model" to import)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rms_norm_eps=1e-5, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    LlamaForCausalLM(cfg).save_pretrained(path)


def checkpoint_params(path) -> dict:
    """Full fp32 parameters of a checkpoint (any layout), keyed like the model's named parameters."""
    from fbt_megatron.checkpoint.model import load_checkpoint_model

    model, _, _ = load_checkpoint_model(path)
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}
