"""The pass input rule, checked against formulas and against the plain model it must reduce to.

- Pass 1 is Megatron's GPT on the same weights, bit for bit (logits, loss, every gradient); the
  fusion's weights are not touched.
- Pass j >= 2 feeds x_t = (W_U((1 - a) h_{t-1} + a h_init)) * sigmoid(W_G e_t) where t has a previous
  position in its document and e_t at position 0 and every document start (computed here from the
  weights, not with the model's helpers).
- The pieces: the prefix mixin, the jitter (training only, from the caller's generator).
- The ``state`` ablation feeds fuse(h_init, e_t) where no state exists.
"""

import pytest
import torch
import torch.nn.functional as F

from fbt_megatron.model.fbt_gpt import build_model
from tests.support.model_helpers import LLAMA, feedback, make_inputs, tiny_model_config


def _pair(model_overrides=None, **feedback_overrides):
    """An FBT model and a fusion-off model built from the same seed (the same stack, embeddings, head)."""
    cfg = tiny_model_config(**(model_overrides or {}))
    torch.manual_seed(0)
    fbt = build_model(cfg, feedback(**feedback_overrides))
    torch.manual_seed(0)
    plain = build_model(cfg, feedback(fusion="off"))
    shared = {n: p for n, p in fbt.named_parameters() if not n.startswith("feedback.")}
    assert sorted(shared) == sorted(n for n, _ in plain.named_parameters())
    for name, p in plain.named_parameters():
        assert torch.equal(p, shared[name]), name  # same weights, not merely close
    return fbt, plain


def stack_inputs(model, ids, doc_start, k):
    captured = []
    handle = model.gpt.decoder.register_forward_pre_hook(
        lambda module, args, kwargs: captured.append(kwargs["hidden_states"].detach().clone()), with_kwargs=True)
    try:
        with torch.no_grad():
            model(ids, doc_start=doc_start, num_passes=k)
    finally:
        handle.remove()
    return captured


def starts_of(doc_start):
    """[S, B] document starts (position 0 included), from the inputs."""
    starts = doc_start.t().clone()
    starts[0] = True
    return starts


def fused_by_formula(model, state, embedded):
    """(W_U s + b_U) * sigmoid(W_G e + b_G), from the weights."""
    fb = model.feedback
    value = F.linear(state, fb.value.weight, fb.value.bias)
    return value * torch.sigmoid(F.linear(embedded, fb.gate.weight, fb.gate.bias))


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_pass_one_is_the_plain_gpt_bitwise(single_process, arch):
    """Loss and gradients of a 1-pass FBT step == the fusion-off model's, bit for bit, on packed rows;
    W_U, W_G and h_init get no gradient."""
    fbt, plain = _pair(LLAMA if arch == "llama" else None)
    ids, labels, doc_start = make_inputs(seq=12)
    losses = {}
    for name, model in (("fbt", fbt), ("plain", plain)):
        out = model(ids, doc_start=doc_start, labels=labels, num_passes=1)
        out.token_loss.sum().backward()
        losses[name] = out.token_loss.detach()
    assert torch.equal(losses["fbt"], losses["plain"])
    grads = dict(plain.named_parameters())
    for name, p in fbt.named_parameters():
        if name.startswith("feedback."):
            assert p.grad is None, name  # the fusion is not part of the single pass
        else:
            assert torch.equal(p.grad, grads[name].grad), name
    with torch.no_grad():  # and the logits
        assert torch.equal(fbt(ids, doc_start=doc_start).logits, plain(ids, doc_start=doc_start).logits)


def test_pass_one_equals_megatron_gpt_model_forward(single_process):
    """The 1-pass FBT loss is Megatron-Core's own GPTModel.forward on the same module (causal mask,
    one document per row, so GPTModel's own positions and RoPE apply)."""
    fbt, _ = _pair()
    fbt.eval()
    ids, labels, _ = make_inputs(seq=12)
    positions = torch.arange(12).expand(2, -1)
    mask = torch.ones(12, 12, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        ours = fbt(ids, labels=labels, num_passes=1).token_loss
        megatron = fbt.gpt(ids, positions, mask, labels=labels)
    torch.testing.assert_close(ours, megatron, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("attention_mask", ["causal", "document_causal"])
def test_pass_inputs_follow_the_formula(single_process, attention_mask):
    """Pass 1 reads e_t everywhere; pass 2 reads e_t at every document start and the fused fed-back
    state elsewhere; pass 3 likewise from pass 2's states."""
    torch.manual_seed(0)
    model = build_model(tiny_model_config(attention_mask=attention_mask), feedback(prefix_mixin=0.3)).eval()
    ids, _, doc_start = make_inputs(seq=10)
    inputs = stack_inputs(model, ids, doc_start, 3)
    starts = starts_of(doc_start)
    assert starts.sum() == 5
    positions = torch.zeros(2, 10, dtype=torch.long)
    for b in range(2):
        first = 0
        for t in range(10):
            first = t if starts[t, b] else first
            positions[b, t] = t - first if attention_mask == "document_causal" else t
    with torch.no_grad():
        embedded = model.gpt.embedding(input_ids=ids, position_ids=positions)  # [S, B, D]
        torch.testing.assert_close(inputs[0], embedded, rtol=0, atol=0)
        h_init = model.feedback.initial_state
        for j in (1, 2):
            top = model(ids, doc_start=doc_start, num_passes=j).hidden  # pass j's top states
            expected = embedded.clone()
            for b in range(2):
                for t in range(1, 10):
                    if not starts[t, b]:
                        state = 0.7 * top[t - 1, b] + 0.3 * h_init
                        expected[t, b] = fused_by_formula(model, state, embedded[t, b])
            torch.testing.assert_close(inputs[j], expected, rtol=1e-6, atol=1e-6)
            assert torch.equal(inputs[j][starts], embedded[starts])  # exactly the embedding at a start


def test_state_ablation_feeds_h_init_where_no_state_exists(single_process):
    torch.manual_seed(0)
    model = build_model(tiny_model_config(), feedback(first_input="state", prefix_mixin=0.0)).eval()
    ids, _, doc_start = make_inputs(seq=10)
    first, second = stack_inputs(model, ids, doc_start, 2)
    starts = starts_of(doc_start)
    with torch.no_grad():
        positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2, 3, 0, 1, 2]])
        embedded = model.gpt.embedding(input_ids=ids, position_ids=positions)
        h_init_input = fused_by_formula(model, model.feedback.initial_state, embedded)
    torch.testing.assert_close(first, h_init_input, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(second[starts], h_init_input[starts], rtol=1e-6, atol=1e-6)
    assert (second[~starts] - h_init_input[~starts]).norm(dim=-1).min() > 1e-4


def test_prefix_mixin_and_jitter(single_process):
    """fed_back(h) = (1 - a) h + a h_init, plus jitter_std * N(0, 1) from the caller's generator in
    training only."""
    torch.manual_seed(0)
    model = build_model(tiny_model_config(), feedback(prefix_mixin=0.25, jitter_std=0.05))
    fb = model.feedback
    h = torch.randn(6, 2, 32)
    mixed = 0.75 * h + 0.25 * fb.initial_state
    fb.eval()
    torch.testing.assert_close(fb.fed_back(h, torch.Generator().manual_seed(5)), mixed, rtol=0, atol=1e-7)
    fb.train()
    noise = torch.randn(h.shape, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(fb.fed_back(h, torch.Generator().manual_seed(5)), mixed + 0.05 * noise,
                               rtol=0, atol=1e-7)


def test_one_pass_computes_no_fusion(single_process):
    """A 1-pass forward never calls W_U or W_G (standard decoding is the plain model); k passes call
    W_G once and W_U once per later pass."""
    torch.manual_seed(0)
    model = build_model(tiny_model_config(), feedback())
    calls = {"value": 0, "gate": 0}
    for name in calls:
        getattr(model.feedback, name).register_forward_hook(lambda *a, n=name: calls.__setitem__(n, calls[n] + 1))
    ids, _, doc_start = make_inputs()
    with torch.no_grad():
        model(ids, doc_start=doc_start, num_passes=1)
        assert calls == {"value": 0, "gate": 0}
        model(ids, doc_start=doc_start, num_passes=3)
    assert calls == {"value": 2, "gate": 1}


@pytest.mark.parametrize("first_input", ["embedding", "state"])
def test_the_token_gate_is_read_exactly_when_a_pass_fuses(single_process, first_input):
    """What the KV-cache decoder and the pipeline's first stage ask before computing sigmoid(W_G e): a
    forward of k passes fuses (reads the gate) when k >= 2, or in pass 1 under the ``state`` rule; a 1-pass
    forward under the embedding rule is the plain model and reads none."""
    torch.manual_seed(0)
    fb = build_model(tiny_model_config(), feedback(first_input=first_input)).feedback
    assert [fb.needs_token_gate(k) for k in (1, 2, 3)] == [first_input == "state", True, True]


def test_scaled_identity_value_init_is_tensor_parallel_invariant(single_process):
    """feedback.value_init=identity: W_U = scale * I (the whole matrix at TP=1; default scale
    2 * init_method_std); gate_init=unit_spread: W_G ~ N(0, 1 / (sqrt(D) * init_method_std))."""
    torch.manual_seed(0)
    model = build_model(tiny_model_config(), feedback(value_init="identity", value_init_scale=0.5))
    torch.testing.assert_close(model.feedback.value.weight, 0.5 * torch.eye(32), rtol=0, atol=0)
    model = build_model(tiny_model_config(init_method_std=0.05), feedback(value_init="identity",
                                                                          gate_init="unit_spread"))
    torch.testing.assert_close(model.feedback.value.weight, 0.1 * torch.eye(32), rtol=0, atol=0)
    want = 1.0 / (32 ** 0.5 * 0.05)
    assert abs(model.feedback.gate.weight.std().item() / want - 1) < 0.1


def test_scaled_identity_on_a_gpu_partition(monkeypatch):
    """Megatron's GPU init calls the init method on this rank's [D/TP, D] rows: rank r of TP gets rows
    r * D/TP .. (r + 1) * D/TP - 1 of the identity, at TP 2 and 4 (the CPU path above initialises the whole
    master weight)."""
    from megatron.core import parallel_state

    from fbt_megatron.model.feedback import scaled_identity_init

    for tp in (2, 4):
        rows = 32 // tp
        for rank in range(tp):
            monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda r=rank: r)
            local = scaled_identity_init(0.5)(torch.full((rows, 32), 9.0))
            torch.testing.assert_close(local, 0.5 * torch.eye(32)[rank * rows:(rank + 1) * rows], rtol=0, atol=0,
                                       msg=f"rank {rank} of {tp}")
