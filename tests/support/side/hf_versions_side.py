"""What a user does first with an export, under whichever transformers runs this script (a fresh process,
offline, fbt_megatron not on the path):

    python tests/support/side/hf_versions_side.py EXPORT_DIR REQUEST.pt RESULT.pt

AutoTokenizer (a stock class) and its pad / padding side / model_max_length, with whether transformers
asked its remote-code question (``input()`` answered "n", as a user pressing Enter does) without and
with trust_remote_code; AutoModelForCausalLM
(trust_remote_code); the forward's logits and loss with and without use_cache; greedy generate in each
decoding mode with and without the KV cache; a batched text-generation pipeline against each prompt
alone; whether num_beams > 1 is refused; and where the remote code's feedback functions come from.
"""

import builtins
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

export, request, result = sys.argv[1:4]
req = torch.load(request)
res = {"version": transformers.__version__}
questions = []


def answer_no(prompt=""):  # transformers' "Do you wish to run the custom code? [y/N]"
    questions.append(prompt)
    return "n"


builtins.input = answer_no
asked = {}
tok = AutoTokenizer.from_pretrained(export)  # a stock tokenizer class, without trust_remote_code
asked["plain"] = len(questions)
trusted = AutoTokenizer.from_pretrained(export, trust_remote_code=True)  # as the README and model card
asked["trusted"] = len(questions) - asked["plain"]
res["tokenizer"] = {"class": type(tok).__name__, "pad_token": tok.pad_token, "pad_token_id": tok.pad_token_id,
                    "padding_side": tok.padding_side, "model_max_length": tok.model_max_length,
                    "encodings": [tok.encode(t) for t in req["texts"]], "asked": asked,
                    "trusted": {"class": type(trusted).__name__, "encodings": [trusted.encode(t) for t in req["texts"]],
                                "pad_token": trusted.pad_token, "padding_side": trusted.padding_side}}
model = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True).eval()
# The remote code's feedback functions: the module the modelling file took them from, and which of its names
# are that module's own objects.
modeling = sys.modules[type(model).__module__]
rule = sys.modules[modeling.fuse.__module__]
res["remote_rule"] = {"beside": Path(rule.__file__).parent == Path(modeling.__file__).parent,
                      "name": Path(rule.__file__).name, "bytes": Path(rule.__file__).read_bytes(),
                      "shared": sorted(n for n, f in vars(modeling).items()
                                       if getattr(f, "__module__", None) == rule.__name__ and getattr(rule, n) is f)}
ids = req["ids"]
with torch.no_grad():
    res["forward"] = {uc: model(ids, labels=ids, use_cache=uc) for uc in (True, False)}
    res["forward"] = {uc: {"logits": o.logits, "loss": o.loss} for uc, o in res["forward"].items()}
    res["forward_passes"] = model(ids, num_passes=model.config.forward_passes, use_cache=False).logits
res["generate"] = {}
prompt = req["prompt"]
for name, kw in {"fused2": {}, "exact": {"prefill_passes": "exact"}, "standard": {"feedback_decoding": "standard"}}.items():
    for uc in (True, False):
        out = model.generate(prompt, max_new_tokens=req["new_tokens"], do_sample=False, eos_token_id=None,
                             use_cache=uc, **kw)
        res["generate"][name, uc] = out[0, prompt.shape[1]:]
try:
    model.generate(prompt, max_new_tokens=2, num_beams=2, do_sample=False)
    res["beams"] = "ran"
except ValueError as e:
    res["beams"] = str(e)
pipe = pipeline("text-generation", model=model, tokenizer=tok)
settings = dict(max_new_tokens=req["new_tokens"], do_sample=False, return_full_text=False)
res["pipeline_batch"] = [o[0]["generated_text"] for o in pipe(req["pipeline_prompts"], batch_size=len(req["pipeline_prompts"]),
                                                                **settings)]
res["pipeline_alone"] = [pipe(p, **settings)[0]["generated_text"] for p in req["pipeline_prompts"]]
res["fbt_megatron_imported"] = sorted(m for m in sys.modules if m.startswith("fbt_megatron"))
torch.save(res, result)
