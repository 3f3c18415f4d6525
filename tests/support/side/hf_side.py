"""The Hugging Face side of the conversion tests, run as a fresh process with HF_HUB_OFFLINE=1.

    python tests/support/side/hf_side.py EXPORT_DIR REQUEST.pt RESULT.pt

Loads the export with transformers alone (trust_remote_code) and records logits for the requested
pass counts, greedy generation in each decoding mode (tokens and per-step logits) and, if the export
has a tokenizer, the encodings of the requested texts.
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

export, request, result = sys.argv[1:4]
req = torch.load(request)
model, info = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True, output_loading_info=True)
model.eval()
res = {"loading_info": {k: sorted(str(x) for x in v) for k, v in info.items()}, "class": type(model).__name__}
with torch.no_grad():
    res["logits"] = {k: model(req["ids"], num_passes=k, use_cache=False).logits for k in req["passes"]}
prompt, modes = req["prompt"], {
    "feedback": {"prefill_passes": "exact"},
    "standard": {"feedback_decoding": "standard"},
    "fused_full": {"prefill_passes": req["prompt"].shape[1]},  # K = prompt length: the exact recurrence
    "fused2": {},  # the export's default: FUSED prefill with 2 passes
}
res["generate"] = {}
for name, kw in modes.items():
    g = model.generate(prompt, max_new_tokens=req["new_tokens"], do_sample=False, return_dict_in_generate=True,
                       output_logits=True, eos_token_id=None, pad_token_id=0, **kw)
    res["generate"][name] = {"tokens": g.sequences, "logits": torch.stack(g.logits, 1)}
# A left-padded batch (the prompt and its last 2 tokens) gives each prompt's own tokens.
short = prompt[:, -2:]
batch = torch.cat([prompt, torch.cat([torch.zeros_like(prompt[:, :-2]), short], 1)])
mask = torch.ones_like(batch)
mask[1, : prompt.shape[1] - 2] = 0
kw = dict(max_new_tokens=req["new_tokens"], do_sample=False, eos_token_id=None, pad_token_id=0)
res["padded_batch"] = model.generate(batch, attention_mask=mask, prefill_passes="exact", **kw)
res["short_alone"] = model.generate(short, prefill_passes="exact", **kw)
if req.get("texts"):
    tok = AutoTokenizer.from_pretrained(export, trust_remote_code=True)
    res["encodings"] = [tok.encode(t) for t in req["texts"]]
    res["decodings"] = [tok.decode(tok.encode(t)) for t in req["texts"]]
res["fbt_megatron_imported"] = sorted(m for m in sys.modules if m.startswith("fbt_megatron"))
torch.save(res, result)
