"""The README.md shipped in an export: what the model is, how it was trained, how to generate."""

from __future__ import annotations

import json


def standard_model_card(config: dict, *, has_tokenizer: bool) -> str:
    prov = config.get("fbt") or {}
    load = ("tok = AutoTokenizer.from_pretrained(path)\nids = tok(\"def add(a, b):\", return_tensors=\"pt\").input_ids"
            if has_tokenizer else "ids = torch.tensor([[1, 2, 3]])  # no tokenizer was exported")
    return f"""---
library_name: transformers
tags: [fbt, llama]
---
# `{prov.get('recipe_name', 'fbt')}`: standard decoding of an FBT model, as a plain Llama

Exported by `fbt convert to-hf --standard` from fbt_megatron: the FBT model's first pass, which is an
ordinary Llama reading token embeddings. The latent-feedback fusion (W_U, W_G, h_init) is not in this
checkpoint, so it decodes without feedback; export without `--standard` for feedback decoding.
Training: {prov.get('steps', 0)} steps, {prov.get('tokens_seen', 0):,} tokens seen.

```python
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path = "."
model = AutoModelForCausalLM.from_pretrained(path)
{load}
out = model.generate(ids, max_new_tokens=32, do_sample=False)
```
"""


def model_card(config: dict, *, has_tokenizer: bool) -> str:
    if config.get("model_type") == "llama":
        return standard_model_card(config, has_tokenizer=has_tokenizer)
    prov = config.get("fbt") or {}
    counts = prov.get("pass_counts") or {}
    total = sum(counts.values())
    mix = ", ".join(f"{k} pass{'es' if k != '1' else ''}: {v} steps ({100 * v / total:.0f}%)"
                    for k, v in sorted(counts.items(), key=lambda kv: int(kv[0]))) if total else "n/a"
    fusion = config.get("feedback_fusion", "off")
    arch = (f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
            f"{config['num_attention_heads']} heads ({config['num_key_value_heads']} key/value), "
            f"MLP {config['intermediate_size']} ({'SwiGLU' if config.get('mlp_gated') else config['hidden_act']}), "
            f"{config.get('norm_type')}, {config.get('position_embedding_type')} positions, "
            f"vocabulary {config['vocab_size']}, {'tied' if config.get('tie_word_embeddings') else 'untied'} "
            "embeddings")
    # The tokenizer is a stock class, but transformers 5's AutoTokenizer reads config.json first, which
    # names the remote-code FBTConfig: without trust_remote_code it asks "Do you wish to run the custom
    # code?" (docs/hf.md). The model below needs trust_remote_code anyway.
    tok_line = ("tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)  # a stock tokenizer class; "
                "transformers 5 reads config.json first\nids = tok(\"def add(a, b):\", return_tensors=\"pt\")"
                ".input_ids" if has_tokenizer else "ids = torch.tensor([[1, 2, 3]])  # no tokenizer was exported")
    decode = ("print(tok.decode(out[0]))" if has_tokenizer else "print(out[0].tolist())")
    return f"""---
library_name: transformers
tags: [fbt, latent-feedback, custom_code]
---
# FBT model `{prov.get('recipe_name', 'fbt')}` (full-bandwidth transformer with latent feedback)

Exported by `fbt convert to-hf` from fbt_megatron. At each position the previous position's top-layer
state is fused with the token embedding, `x_t = (W_U h_(t-1)) * sigmoid(W_G e_t)` (fusion
`{fusion}`, prefix mixin {config.get('feedback_prefix_mixin')}), and fed to the bottom of the stack.

- Architecture: {arch}.
- Training: recipe `{prov.get('recipe_name')}`, {prov.get('steps', 0)} steps, {prov.get('tokens_seen', 0):,} tokens seen.
- Pass mix (multi-pass teacher forcing steps): {mix}.
- Default fused passes of a plain forward: {config.get('forward_passes')}.

## Generate

The modelling code (`modeling_fbt.py`, transformers' Llama layers + the fusion, and the feedback rule it
imports, `feedback_rule.py`) ships in this folder:

```python
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path = "."  # this folder
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
{tok_line}
out = model.generate(ids, max_new_tokens=32, do_sample=False)          # latent feedback, FUSED prefill
out = model.generate(ids, max_new_tokens=32, prefill_passes="exact")   # prompt through the recurrence
out = model.generate(ids, max_new_tokens=32, feedback_decoding="standard")  # no feedback
{decode}
logits = model(ids, num_passes=3).logits                               # 3 fused passes
```

`prefill_passes=K` runs K fused passes over the prompt (default {config.get('prefill_passes')}, the
paper's FUSED prefill); `"exact"` runs it token by token through the recurrence. Greedy and sampling are supported, with or without `use_cache`; beam search is refused (`num_beams > 1` raises). Batched generation pads on the left (the tokenizer's pad token is EOS unless the source had one). Works with transformers 4.57 to 5.x.

## Notes

Latent feedback is trained: a stock checkpoint cannot switch it on without a dedicated feedback phase.
Parity with the training framework (logits for 1-3 passes, greedy tokens) is tested by fbt_megatron.

## Recipe

```json
{json.dumps(prov, indent=1, sort_keys=True)}
```
"""
