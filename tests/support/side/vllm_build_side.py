"""tests/integration/test_serving_vllm.py::test_plugin_built_without_an_engine, in vLLM's venv, without an engine:
the plugin's model built as vLLM's model runner builds it (``FBTForCausalLM(vllm_config=...)`` under the current
vLLM config; the export's config, an ``FBTConfig``, with a stack of no layers, so the plugin's own code is what
runs: its config checks, its refusals, its start-up warning, its weights' loading), and its state cache.

Writes {check: outcome} to argv[1], an outcome being "ok" or "ExceptionType: message":
- "servable" (the export's config), "unservable" {field: outcome} (one architecture field that is not Llama-class
  each), "bad settings" {field: outcome} (one setting outside its values each), "prefill_passes" {repr(value): outcome};
- "pipeline parallel 2", "lora" {fusion: outcome}: the refusals (and what is served);
- "built" {case: {"outcome", "prefill_passes", "runner found", "warned"}}: built in a model runner's
  ``load_model`` (as vLLM does) or not, exact or K-pass prefill, without a fusion, from a plain Llama config
  naming no ``prefill_passes``;
- "gate table" {"default": max abs error of the table's vocabulary rows against the formula (or None: no
  table), "off": whether a table was built with ``feedback_gate_table: false``, "in state_dict"};
- "layer names": the fusion's linear layers' names (``prefix``, what quantization configs match);
- "loaded" (load_weights reports every checkpoint weight), "fusion weights" (max abs error of the fusion's
  parameters against the checkpoint's);
- "first decode step" {"its slots", "a block table not giving the slots"}: the outcome of the first step, a
  decode step, on the model as built;
- "state cache": how the state cache grows slot by slot (its sizes, rows always enough, states kept, a step
  using every row), and when the step's dtype changes."""

import json
import logging
import sys
from types import SimpleNamespace

import torch
from transformers import LlamaConfig
from vllm.config import VllmConfig, set_current_vllm_config
from vllm_one_rank import one_rank_world

from fbt_megatron.model.feedback_rule import token_gate
from fbt_megatron.model.modeling_fbt import FBTConfig
from fbt_megatron.serving import vllm_model

D, VOCAB = 16, 64  # a vocabulary that vLLM's embedding does not pad (a multiple of 64, as most are)
TINY = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=32, num_hidden_layers=0, num_attention_heads=2,
            feedback_fusion="glu", feedback_prefix_mixin=0.1, prefill_passes=2)  # the export's fields (hf/export.py)


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


WARNINGS = Warnings()
logging.getLogger("fbt_megatron.serving").addHandler(WARNINGS)


def outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except Exception as e:  # noqa: BLE001 - the message is the outcome
        return f"{type(e).__name__}: {e}"


class ModelLoader:
    """vLLM's model loader, between the runner and the model: it has a ``load_model`` too, but no input batch."""

    def load_model(self, vc):
        return vllm_model.FBTForCausalLM(vllm_config=vc)


class ModelRunner:
    """What the plugin looks for up the stack while it is built (vLLM's ``GPUModelRunner.load_model`` and the
    CPU runner's, which build the model through the model loader's ``load_model``): a ``self`` with an
    ``input_batch`` and ``load_model``."""

    def __init__(self, vc):
        self.vc, self.input_batch, self.model = vc, SimpleNamespace(num_prompt_tokens=[], num_reqs=0), None

    def load_model(self):
        self.model = ModelLoader().load_model(self.vc)


class StandInStack(torch.nn.Module):
    def __init__(self, embed_tokens):
        super().__init__()
        self.embed_tokens = embed_tokens

    def embed_input_ids(self, ids):
        return self.embed_tokens(ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return inputs_embeds


def build(vc, hf, runner=False):
    """{"outcome", "prefill_passes", "runner found", "warned"} of building the model for ``hf``; the model."""
    vc.model_config = SimpleNamespace(hf_config=hf, dtype=torch.float32, head_dtype=torch.float32)  # ModelConfig's
    WARNINGS.records.clear()
    box = {}

    def make():
        if runner:
            r = ModelRunner(vc)
            r.load_model()
            box["model"], box["runner"] = r.model, r
        else:
            box["model"] = vllm_model.FBTForCausalLM(vllm_config=vc)

    with set_current_vllm_config(vc):
        res = {"outcome": outcome(make)}
    m = box.get("model")
    if m is not None:
        found = m._runner() if m._runner is not None else None
        res.update({"prefill_passes": m.prefill_passes, "runner found": found is not None and found is box.get("runner"),
                    "warned": any("model runner not found" in w for w in WARNINGS.records)})
    return res, m


def main(out):
    result = {}
    result["servable"] = outcome(lambda: vllm_model.check_servable(FBTConfig(**TINY)))
    wrong = {"mlp_gated": False, "norm_type": "LayerNorm", "position_embedding_type": "learned_absolute",
             "qkv_bias": True}
    result["unservable"] = {k: outcome(lambda: vllm_model.check_servable(FBTConfig(**{**TINY, k: v})))
                            for k, v in wrong.items()}
    result["unservable"]["qkv_bias with attention_bias"] = outcome(
        lambda: vllm_model.check_servable(FBTConfig(**{**TINY, "qkv_bias": True, "attention_bias": True})))
    settings = {"feedback_fusion": "mul", "feedback_first_input": "token", "feedback_gate_table": "yes",
                "feedback_decoding": "beam"}
    result["bad settings"] = {k: outcome(lambda: vllm_model.check_servable(FBTConfig(**{**TINY, k: v})))
                              for k, v in settings.items()}
    result["prefill_passes"] = {repr(v): outcome(lambda: vllm_model.check_servable(FBTConfig(**{**TINY, "prefill_passes": v})))
                                for v in (1, 2, 7, "exact", 0, -1, True, 2.0, "2", "two", None)}

    vc = VllmConfig()
    built = {}
    built["K passes"], model = build(vc, FBTConfig(**TINY))
    result["layer names"] = [model.feedback.value_proj.prefix, model.feedback.gate_proj.prefix]
    built["K passes in a model runner"], _ = build(vc, FBTConfig(**TINY), runner=True)
    built["exact"], _ = build(vc, FBTConfig(**{**TINY, "prefill_passes": "exact"}))
    built["fusion off"], _ = build(vc, FBTConfig(**{**TINY, "feedback_fusion": "off"}))
    plain = {k: v for k, v in TINY.items() if k != "prefill_passes"}  # model_type llama: no FBTConfig defaults
    built["a Llama config naming no prefill_passes"], _ = build(
        vc, LlamaConfig(**plain, feedback_bias=False, feedback_first_input="embedding"))
    vc.parallel_config.pipeline_parallel_size = 2
    result["pipeline parallel 2"] = build(vc, FBTConfig(**TINY))[0]["outcome"]
    vc.parallel_config.pipeline_parallel_size = 1
    vc.lora_config = SimpleNamespace(max_loras=1, max_lora_rank=8)  # --enable-lora
    result["lora"] = {fusion: build(vc, FBTConfig(**{**TINY, "feedback_fusion": fusion}))[0]["outcome"]
                      for fusion in ("glu", "additive", "off")}
    vc.lora_config = None
    result["built"] = built

    # the weights as an export names them; the gate table built from them when they load
    torch.manual_seed(0)
    weights = {"model.embed_tokens.weight": torch.randn(VOCAB, D), "model.norm.weight": torch.ones(D),
               "lm_head.weight": torch.randn(VOCAB, D), "feedback.initial_state": torch.randn(D),
               "feedback.value_proj.weight": torch.randn(D, D) * 0.3, "feedback.gate_proj.weight": torch.randn(D, D) * 0.3}
    expected = token_gate(weights["model.embed_tokens.weight"] @ weights["feedback.gate_proj.weight"].t(), "glu")
    table = {}
    for case, hf in (("default", FBTConfig(**TINY)), ("off", FBTConfig(**TINY, feedback_gate_table=False))):
        _, m = build(vc, hf)
        with set_current_vllm_config(vc):
            loaded = m.load_weights(list(weights.items()))
        t = m.feedback.gate_table
        table[case] = None if t is None else float((t[:VOCAB] - expected).abs().max())
        table[f"{case} in state_dict"] = [k for k in m.state_dict() if "gate_table" in k]
    result["gate table"] = table
    # what load_weights reports loaded (vLLM fails on a checkpoint weight left out) and the fusion's weights
    result["loaded"] = sorted(loaded) == sorted(weights)
    params = dict(m.named_parameters())
    result["fusion weights"] = max(float((params[k].detach() - v).abs().max()) for k, v in weights.items()
                                   if k.startswith("feedback."))
    for module in m.modules():  # as vLLM's loader does after loading (the CPU GEMM prepacks its weights)
        if hasattr(module, "quant_method"):
            module.quant_method.process_weights_after_loading(module)

    # the first step (a decode step) of a model as built checks the block table against the step's slots (the
    # stack of no layers stood in for by the identity: vLLM's would want its compilation config)
    m.model = StandInStack(m.model.embed_tokens)
    bs, first = m.block_size, {}
    for case, second in (("a block table not giving the slots", 7), ("its slots", 5)):
        meta = SimpleNamespace(num_actual_tokens=2, query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
                               max_query_len=1, block_table=torch.tensor([[3], [5]], dtype=torch.int32),
                               slot_mapping=torch.tensor([3 * bs + 1, second * bs + 1]))
        vllm_model.get_forward_context = lambda: SimpleNamespace(attn_metadata={"layer.0": meta})
        with set_current_vllm_config(vc):
            first[case] = outcome(lambda: m.forward(torch.tensor([1, 2]), torch.tensor([1, 1])))
    result["first decode step"] = first

    # the state cache, one slot more each step (a KV cache filling up), then a step in another dtype
    states, like = vllm_model.FeedbackStates(), torch.zeros(3, D)
    sizes, enough, kept, last = [], True, True, None
    for slots in range(1, 1001):
        t = states.ensure(slots, like)
        if t is not last:
            sizes.append(t.shape[0])
        enough &= t.shape[0] >= slots and t.shape[1] == D
        t[slots - 1] = slots
        kept &= bool((t[:slots, 0] == torch.arange(1, slots + 1)).all())
        last = t
    full = states.ensure(last.shape[0], like) is last  # a step using every row
    t = states.ensure(10, like.double())
    result["state cache"] = {"sizes": sizes, "rows enough": bool(enough), "states kept": bool(kept),
                             "full, not grown": full,
                             "dtype change keeps the states": t.dtype == torch.float64 and t.shape[0] >= 1000
                             and bool((t[:1000, 0] == torch.arange(1, 1001)).all())}
    json.dump(result, open(out, "w"))


if __name__ == "__main__":
    with one_rank_world():
        pass
    main(sys.argv[1])
