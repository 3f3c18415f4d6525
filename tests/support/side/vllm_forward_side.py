"""tests/integration/test_serving_vllm.py::test_plugin_forward_against_the_recurrence, in vLLM's venv, without an engine: the
plugin's ``FBTForCausalLM.forward`` (the state cache by KV slot, the decode and general layouts, K-pass and exact
prefill, a recompute after preemption) driven step by step by a small scheduler written here, on a position-wise
stand-in for vLLM's Llama stack (``top_t = tanh(x_t A + P[t])``), against the recurrence written from its
formula: ``h_t = f(x_t)``, ``x_0 = e_0``, ``x_t = (W_U((1 - a) h_{t-1} + a h_init)) * sigmoid(W_G e_t)``.

The scheduler gives blocks out of order and reuses freed ones, so a state is only found through the block
table and a reused slot holds a stale state. Writes {scenario: max abs error, ...} to argv[1]."""

import json
import sys
import weakref
from collections import Counter
from types import SimpleNamespace

import torch
from vllm_one_rank import one_rank_world

from fbt_megatron.serving import vllm_model

D, VOCAB, BLOCK, MIXIN = 16, 40, 4, 0.1
torch.manual_seed(0)
E = torch.randn(VOCAB, D)
A = torch.randn(D, D) / D ** 0.5
P = torch.randn(64, D) * 0.5


class Stack(torch.nn.Module):
    """vLLM's ``LlamaModel`` call signature on a position-wise map: a token's top state depends on its own input
    and position only, so the recurrence can be written per request without a KV cache. ``calls``: the passes
    over the stack."""

    calls = 0

    def embed_input_ids(self, ids):
        return E[ids]

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        self.calls += 1
        x = inputs_embeds if inputs_embeds is not None else E[input_ids]
        return torch.tanh(x @ A + P[positions])


def f(x, pos):
    return torch.tanh(x @ A + P[pos])


def reference(tokens, w, prompt_passes=None):
    """Top states of one request from the formula: the recurrence, or with ``prompt_passes`` K the prompt's K
    Jacobi passes (pass 1: e_t; pass k: the previous position's pass k-1 state fed back) and the recurrence after."""
    e = E[torch.tensor(tokens)]
    gate = torch.sigmoid(e @ w["gate"].t())

    def fused(h_prev, t):
        return (((1 - MIXIN) * h_prev + MIXIN * w["h_init"]) @ w["value"].t()) * gate[t]

    if prompt_passes is None:
        tops = []
        for t in range(len(tokens)):
            tops.append(f(e[0] if t == 0 else fused(tops[-1], t), t))
        return torch.stack(tops)
    plen, steps = prompt_passes
    top = f(e[:plen], torch.arange(plen))
    for _ in range(steps - 1):
        x = torch.stack([e[0]] + [fused(top[t - 1], t) for t in range(1, plen)])
        top = f(x, torch.arange(plen))
    tops = list(top)
    for t in range(plen, len(tokens)):
        tops.append(f(fused(tops[-1], t), t))
    return torch.stack(tops)


class Scheduler:
    """Requests, blocks given out in a fixed scrambled order (freed blocks first), and each step's attention
    metadata as vLLM's CPU backend lays it out (rows in the order scheduled)."""

    def __init__(self, model):
        # (never block 0: vLLM's block pool keeps it as its null block)
        self.model, self.free = model, [9, 3, 14, 6, 1, 11, 7, 12, 2, 15, 5, 10, 8, 4, 13] + list(range(16, 48))
        self.blocks, self.done, self.tops = {}, {}, {}

    def release(self, name):
        self.free = self.blocks.pop(name) + self.free  # reused first: its slots hold stale states
        self.done[name] = 0

    def step(self, work, tokens, pad=0, slot_shift=0, empty_rows=0, embeds=False, warm_up=False):
        """``work``: [(name, n)] schedules the next n tokens of each request; returns the step's tops by request.
        ``pad`` rows of padding tokens (slot -1); ``empty_rows`` request rows without tokens after the real ones
        (vLLM pads the request count so, ``query_start_loc`` repeating its last value); ``embeds``: the tokens
        given as embeddings (``inputs_embeds``, no token ids); ``warm_up``: every slot -1, as vLLM's dummy runs
        (warm-up, profiling) lay them out."""
        ids, pos, slots, rows, lengths = [], [], [], [], []
        for name, n in work:
            start = self.done.setdefault(name, 0)
            blocks = self.blocks.setdefault(name, [])
            while len(blocks) * BLOCK < start + n:
                blocks.append(self.free.pop(0))
            for p in range(start, start + n):
                ids.append(tokens[name][p])
                pos.append(p)
                slots.append(blocks[p // BLOCK] * BLOCK + p % BLOCK)
            rows.append(blocks)
            lengths.append(n)
        rows += [[0]] * empty_rows
        lengths += [0] * empty_rows
        table = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.int32)
        for i, r in enumerate(rows):
            table[i, : len(r)] = torch.tensor(r)
        n = len(ids)
        qsl = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        meta = SimpleNamespace(num_actual_tokens=n, query_start_loc=qsl, max_query_len=max(lengths), block_table=table,
                               slot_mapping=torch.tensor(slots + [-1] * pad, dtype=torch.long) + slot_shift)
        if warm_up:
            meta.slot_mapping.fill_(-1)
        vllm_model.get_forward_context = lambda: SimpleNamespace(attn_metadata={"layer.0": meta})
        ids = torch.tensor(ids + [0] * pad)
        top = self.model.forward(None, torch.tensor(pos + [0] * pad), inputs_embeds=E[ids]) if embeds else \
            self.model.forward(ids, torch.tensor(pos + [0] * pad))
        assert top.shape[0] == n + pad
        out, i = {}, 0
        for name, k in work:
            out[name] = top[i: i + k]
            self.tops.setdefault(name, {}).update({self.done[name] + j: top[i + j] for j in range(k)})
            self.done[name] += k
            i += k
        return out

    def states(self, name):
        return torch.stack([self.tops[name][p] for p in sorted(self.tops[name])])


class Runner:
    """The model runner's input batch the plugin reads the prompt lengths from."""

    def __init__(self):
        self.input_batch = SimpleNamespace(num_prompt_tokens=[], num_reqs=0)


def build(passes, decoding="feedback", runner=None, gate_table=False, fusion=True):
    """The plugin's model on the stand-in stack (``gate_table``: the vocabulary's gate table built, as loading the
    weights does by default; ``fusion`` False: an export with ``feedback_fusion: off``) and its fusion's weights."""
    fb = vllm_model.LatentFeedback(SimpleNamespace(hidden_size=D, feedback_fusion="glu", feedback_prefix_mixin=MIXIN,
                                                   feedback_bias=False, feedback_first_input="embedding"))
    with torch.no_grad():
        for p in fb.parameters():
            p.copy_(torch.randn_like(p) * 0.4)
    w = {"value": fb.value_proj.weight.detach().clone(), "gate": fb.gate_proj.weight.detach().clone(),
         "h_init": fb.initial_state.detach().clone()}
    for m in fb.modules():  # as vLLM's loader does after loading (the CPU GEMM prepacks its weights)
        if hasattr(m, "quant_method"):
            m.quant_method.process_weights_after_loading(m)
    if gate_table:
        fb.build_gate_table(E, w["gate"])
    model = vllm_model.FBTForCausalLM.__new__(vllm_model.FBTForCausalLM)
    torch.nn.Module.__init__(model)
    model.model, model.feedback, model.decoding, model.prefill_passes = Stack(), fb if fusion else None, decoding, passes
    model.block_size, model.states, model._layout_checked = BLOCK, vllm_model.FeedbackStates(), False
    model.step_kinds, model._runner = Counter(), weakref.ref(runner) if runner is not None else None
    return model, w


def err(a, b):
    return float((a - b).abs().max())


def counting_step_layout():
    """Count the calls of ``step_layout`` (the general layout and its block-table check) the forward makes."""
    calls = Counter()
    step_layout = vllm_model.step_layout

    def counted(*args, **kwargs):
        calls["step_layout"] += 1
        return step_layout(*args, **kwargs)

    vllm_model.step_layout = counted
    return calls


def main(out):
    tok = {"a": [5, 17, 30, 4, 9, 22, 8, 31, 2, 36, 21], "b": [1, 7, 33, 12, 3, 3, 25, 18], "c": [11, 23], "d": [6, 19, 24, 38, 0, 14, 27],
           "old": [2, 4, 6, 8, 10, 12], "e": [16, 3, 39], "long": [(7 * i + 3) % VOCAB for i in range(D + 4)],
           **{f"s{i}": [(5 * i + 1) % VOCAB, (3 * i + 2) % VOCAB] for i in range(D)}}
    result = {}
    layouts = counting_step_layout()
    with torch.no_grad():
        # exact prefill of two prompts in one step, then decode steps (a, b), with a padded row on one of them; the
        # gate read from the vocabulary's table
        m, w = build("exact", gate_table=True)
        s = Scheduler(m)
        s.step([("a", 5), ("b", 3)], tok)
        result["exact prefill passes"] = m.model.calls  # at most the longest prompt's length
        for i in range(3):
            s.step([("a", 1), ("b", 1)], tok, pad=2 if i == 1 else 0)
        result["exact prefill, decode"] = max(err(s.states(n), reference(tok[n][: s.done[n]], w)) for n in "ab")
        result["exact kinds"] = {**m.step_kinds, "step_layout": layouts.pop("step_layout")}

        # a 1-token prompt among decoding requests, in a reused block that holds another request's states; its
        # next token (position 1) too, whose own slot holds the other request's state
        s.step([("old", 6)], tok)
        s.release("old")
        s.step([("a", 1), ("c", 1), ("b", 1)], tok)  # max_query_len 1: the decode layout
        s.step([("a", 1), ("c", 1), ("b", 1)], tok)
        result["one-token prompt among decodes"] = max(err(s.states(n), reference(tok[n][: s.done[n]], w))
                                                       for n in "abc")
        # chunked prefill: a prompt in two chunks, the second starting from a carried state; the first chunk's
        # step also decodes a (a one-token request row in a step on the general path)
        s.step([("d", 4), ("a", 1)], tok)
        s.step([("d", 3)], tok)
        result["chunked exact prefill"] = max(err(s.states(n), reference(tok[n][: s.done[n]], w)) for n in "da")

        # decode steps of more requests than the block table has columns (D 1-token prompts, a block each): the
        # decode layout, also with a padded row; a prompt whose first chunk is one token in a step with an empty
        # request row (one pass), its second chunk from position 1 in another such step
        m, w = build("exact")
        s = Scheduler(m)
        short = [f"s{i}" for i in range(D)]
        s.step([(n, 1) for n in short], tok)
        s.step([(n, 1) for n in short], tok, pad=1)
        result["short kinds"] = dict(m.step_kinds)
        calls = m.model.calls
        s.step([("e", 1)], tok, empty_rows=1)
        result["one-token chunk passes"] = m.model.calls - calls
        s.step([("e", 2)], tok, empty_rows=1)
        result["short requests, a chunk from position 1"] = max(err(s.states(n), reference(tok[n][: s.done[n]], w))
                                                                for n in short + ["e"])

        # the paper's FUSED prefill (2 passes), decode, then a preemption: recomputed as one prefill
        runner = Runner()
        m, w = build(2, runner=runner)
        s = Scheduler(m)
        runner.input_batch = SimpleNamespace(num_prompt_tokens=[5, 3], num_reqs=2)
        s.step([("a", 5), ("b", 3)], tok)
        result["2-pass prefill passes"] = m.model.calls
        runner.input_batch = SimpleNamespace(num_prompt_tokens=[5, 3], num_reqs=2)
        for _ in range(3):
            s.step([("a", 1), ("b", 1)], tok)
        result["2-pass prefill, decode"] = max(err(s.states(n), reference(tok[n][: s.done[n]], w, (p, 2)))
                                               for n, p in (("a", 5), ("b", 3)))
        before = s.states("a").clone()
        s.release("a")
        s.tops.pop("a")
        runner.input_batch = SimpleNamespace(num_prompt_tokens=[5], num_reqs=1)
        calls = m.model.calls
        s.step([("a", 8)], tok)
        result["recompute after preemption"] = err(s.states("a"), before)
        result["recompute passes"] = m.model.calls - calls
        # an input batch that does not say how many request rows it holds is not read: the passes run over all
        runner.input_batch = SimpleNamespace(num_prompt_tokens=[5])
        s.release("a")
        s.tops.pop("a")
        s.step([("a", 8)], tok)
        result["input batch without num_reqs"] = err(s.states("a"), reference(tok["a"][:8], w, (8, 2)))
        # a prompt longer than the hidden size, beside another, in one step
        runner.input_batch = SimpleNamespace(num_prompt_tokens=[len(tok["long"]), 3], num_reqs=2)
        s = Scheduler(m)
        s.step([("long", len(tok["long"])), ("b", 3)], tok)
        result["2-pass prefill of a prompt longer than D"] = max(
            err(s.states(n), reference(tok[n][: s.done[n]], w, (s.done[n], 2))) for n in ("long", "b"))

        # inputs given as embeddings (no token ids): the gate computed per token, not read from the table
        m, w = build("exact", gate_table=True)
        s = Scheduler(m)
        s.step([("a", 5)], tok, embeds=True)
        s.step([("a", 1)], tok, embeds=True)
        result["inputs as embeddings"] = err(s.states("a"), reference(tok["a"][:6], w))
        result["embeddings kinds"] = dict(m.step_kinds)

        # standard decoding of the same model: the first pass, token embeddings in, no gate computed
        m, w = build("exact", decoding="standard")
        s = Scheduler(m)
        s.step([("a", 5)], tok)
        s.step([("a", 1)], tok)
        result["standard decoding"] = err(s.states("a"), f(E[torch.tensor(tok["a"][:6])], torch.arange(6)))
        result["standard kinds"] = dict(m.step_kinds)
        # an export without a fusion (feedback_fusion: off): vLLM's Llama on the token ids
        m, w = build("exact", fusion=False)
        s = Scheduler(m)
        s.step([("a", 5)], tok)
        s.step([("a", 1)], tok)
        result["no fusion"] = err(s.states("a"), f(E[torch.tensor(tok["a"][:6])], torch.arange(6)))

        # a warm-up run (no real slots) is stateless, and so is a step without tokens (padding only); a block
        # table that does not give the slots is refused
        m, w = build("exact")
        s = Scheduler(m)
        top = s.step([("a", 3)], tok, warm_up=True)["a"]
        result["warm-up"] = err(top, f(E[torch.tensor(tok["a"][:3])], torch.arange(3)))
        result["warm-up kinds"] = dict(m.step_kinds)
        meta = SimpleNamespace(num_actual_tokens=0, query_start_loc=torch.zeros(1, dtype=torch.int32), max_query_len=0,
                               block_table=torch.zeros(0, 1, dtype=torch.int32), slot_mapping=torch.full((2,), -1))
        vllm_model.get_forward_context = lambda: SimpleNamespace(attn_metadata={"layer.0": meta})
        top = m.forward(torch.tensor([3, 4]), torch.tensor([0, 0]))
        result["a step without tokens"] = err(top, f(E[torch.tensor([3, 4])], torch.tensor([0, 0])))
        try:
            Scheduler(m).step([("b", 3)], tok, slot_shift=1)
            result["wrong block table"] = "not refused"
        except RuntimeError as e:
            result["wrong block table"] = str(e)
    json.dump(result, open(out, "w"))


if __name__ == "__main__":
    with one_rank_world():
        main(sys.argv[1])
