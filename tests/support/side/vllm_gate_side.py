"""tests/integration/test_serving_vllm.py::test_plugin_gate_table_formula, in vLLM's venv: the plugin's fusion (glu and additive, with
biases) against its formula in float64, the token's gate computed per token and read from the gate table built from
the raw W_G (vLLM's CPU GEMM has prepacked and dropped its own copy), and the stack input of flattened tokens under
the ``state`` rule (h_init fused where a token has no previous state). Writes {mode: {per_token, table, stack_input:
max abs error, reads_table}} to argv[1], and under "rule" whether the plugin's fusion methods and gate-table
function are the export modelling file's and the shared rule's own objects."""

import json
import sys
from types import SimpleNamespace

import torch
from vllm_one_rank import one_rank_world

from fbt_megatron.model import feedback_rule, modeling_fbt
from fbt_megatron.serving import vllm_model
from fbt_megatron.serving.vllm_model import LatentFeedback

torch.manual_seed(0)
d, vocab = 32, 50
E = torch.randn(vocab, d)
ids = torch.tensor([3, 0, 49, 3, 17])
h = torch.randn(len(ids), d)
errors = {}
with one_rank_world():
    for mode in ("glu", "additive"):
        fb = LatentFeedback(SimpleNamespace(hidden_size=d, feedback_fusion=mode, feedback_prefix_mixin=0.0,
                                            feedback_bias=True, feedback_first_input="state"))
        w = {n: torch.randn_like(p) * 0.3 for n, p in fb.named_parameters()}
        with torch.no_grad():
            for n, p in fb.named_parameters():
                p.copy_(w[n])
        for m in fb.modules():  # as vLLM's loader does after loading: on CPU the GEMM prepacks W and drops it
            if hasattr(m, "quant_method"):
                m.quant_method.process_weights_after_loading(m)
        # the fusion from its formula, in float64: (W_U h + b_U) * sigmoid(W_G e + b_G), or + (W_G e + b_G)
        gate = E[ids].double() @ w["gate_proj.weight"].double().t() + w["gate_proj.bias"].double()
        value = h.double() @ w["value_proj.weight"].double().t() + w["value_proj.bias"].double()
        expected = value * torch.sigmoid(gate) if mode == "glu" else value + gate
        # the state rule: where a token has no previous state, h_init takes h's place
        reset = torch.tensor([True, False, False, True, False])
        value0 = w["initial_state"].double() @ w["value_proj.weight"].double().t() + w["value_proj.bias"].double()
        expected0 = value0 * torch.sigmoid(gate) if mode == "glu" else value0 + gate
        stack = fb.stack_input(h, E[ids], fb.token_gate(E[ids]), reset).double()
        stack = stack - torch.where(reset[:, None], expected0, expected)
        per_token = fb.fuse(h, fb.token_gate(E[ids]))
        fb.build_gate_table(E, w["gate_proj.weight"], w["gate_proj.bias"])
        from_table = fb.fuse(h, fb.token_gate(E[ids], ids))
        errors[mode] = {"per_token": float((per_token.double() - expected).abs().max()),
                        "table": float((from_table.double() - expected).abs().max()),
                        "stack_input": float(stack.abs().max()),
                        "reads_table": fb.reads_table(ids) and not fb.reads_table(None)}
methods = ("fed_back", "shift_states", "fuse", "stateless_input", "stack_input")
errors["rule"] = {**{m: getattr(LatentFeedback, m) is getattr(modeling_fbt.LatentFeedback, m) for m in methods},
                  "gate table": vllm_model.token_gate is feedback_rule.token_gate}
json.dump(errors, open(sys.argv[1], "w"))
