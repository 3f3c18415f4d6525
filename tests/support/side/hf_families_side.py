"""Loads the family exports under whichever transformers runs this script (a fresh process, offline,
fbt_megatron not on the path) and records each one's class and 1-pass logits:

    python tests/support/side/hf_families_side.py ROOT REQUEST.pt RESULT.pt

``REQUEST.pt``: {"ids": LongTensor, "exports": [relative export directories under ROOT]}.
"""

import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

root, request, result = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
req = torch.load(request)
res = {"version": transformers.__version__}
for name in req["exports"]:
    model = AutoModelForCausalLM.from_pretrained(root / name, trust_remote_code=True).eval()
    with torch.no_grad():
        kw = {"num_passes": 1} if type(model).__name__ == "FBTForCausalLM" else {}
        res[name] = {"class": type(model).__name__, "logits": model(req["ids"], **kw).logits}
torch.save(res, result)
