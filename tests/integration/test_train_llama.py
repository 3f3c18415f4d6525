"""A Llama-shaped FBT model trains and resumes: interrupted at step 5 under TP=2 (SwiGLU fc1 halves
and a vocabulary padded to 256 rows in the checkpoint's factories) and resumed under TP=1 (padded to
128) with full activation recomputation, it follows the straight TP=1 run."""

import math

from tests.support.distributed import run_distributed
from tests.support.training import losses, tiny_recipe, train_fn

LLAMA_MODEL = {"activation": "swiglu", "ffn_hidden_size": 96, "normalization": "RMSNorm", "num_query_groups": 2,
               "add_bias_linear": False, "tie_embeddings": False, "rotary_base": 500000, "vocab_size": 120}
SECTIONS = dict(model=LLAMA_MODEL, train={"steps": 10}, data={"synthetic": {"vocab_size": 120}},
                schedule={"feedback_start_step": 4, "mix": [0.2, 0.5, 0.3], "seed": 3},
                checkpoint={"every": 1000, "at_end": True})


def test_llama_shaped_model_trains_and_resumes_under_new_layout(tmp_path):
    straight = run_distributed(train_fn, 1, tiny_recipe(tmp_path / "straight", **SECTIONS))[0]
    ref = losses(straight)
    assert all(math.isfinite(x) for x in ref) and straight["skipped_steps"] == 0, ref
    assert max(h[1] for h in straight["history"][5:]) > 1  # feedback steps after the resume point

    first = tiny_recipe(tmp_path / "run", **SECTIONS)
    first["parallel"].update(tensor=2, zero_stage=1)
    first["model"]["recompute"] = "selective"
    first["train"]["stop_at_step"] = 5
    a = run_distributed(train_fn, 2, first)[0]
    second = tiny_recipe(tmp_path / "run", **SECTIONS)
    second["parallel"].update(tensor=1, zero_stage=2)
    second["model"]["recompute"] = "full"
    b = run_distributed(train_fn, 1, second)[0]
    assert b["history"][0][0] == 5 and b["step"] == 10
    got = losses(a) + losses(b)
    assert max(abs(x - y) for x, y in zip(got, ref)) < 1e-5, (got, ref)
    assert [h[4] for h in a["history"] + b["history"]] == [h[4] for h in straight["history"]]  # same samples
