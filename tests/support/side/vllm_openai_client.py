"""The client side of the OpenAI-server test (tests/integration/test_serving_vllm.py), run with the vLLM venv's python
(it has the ``openai`` package):

    python tests/support/side/vllm_openai_client.py BASE_URL REQUEST.json RESULT.json

REQUEST: {"prompts": [[ids]], "max_tokens": N}. One completion request for the batch of prompts (token ids),
greedy (temperature 0), asking vLLM for the generated token ids (``return_token_ids``, a vLLM extension of
the OpenAI API, passed through ``extra_body``). RESULT: {"model": served model id, "tokens": [[ids]] in
prompt order, "text": [str]}.
"""

import json
import sys

from openai import OpenAI

if __name__ == "__main__":
    base_url, request, result = sys.argv[1:4]
    req = json.load(open(request))
    client = OpenAI(base_url=base_url, api_key="EMPTY", timeout=600, max_retries=0)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=req["prompts"], max_tokens=req["max_tokens"], temperature=0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    choices = sorted(out.choices, key=lambda c: c.index)
    json.dump({"model": model, "tokens": [c.model_dump()["token_ids"] for c in choices],
               "text": [c.text for c in choices]}, open(result, "w"))
