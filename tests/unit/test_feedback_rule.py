"""One feedback rule (issue 42, item 2): ``fbt_megatron/model/feedback_rule.py``'s plain torch functions, each
against its formula written out here, and the proof that the Megatron model, the Hugging Face remote code and
the vLLM plugin run those same function objects (not copies of the rule), and that an export ships the file
as it is in the package.

    mix:     s = (1 - a) h + a h_init
    gate:    token_gate = sigmoid(W_G e) (glu), W_G e (additive)
    fuse:    x = (W_U s) * token_gate (glu), W_U s + token_gate (additive)
    shift:   position t receives s_{t-1}; the first position (and every reset) h_init
    input:   x_t = e_t where no previous state exists (first_input: state: fuse(h_init, e_t)), else fuse(s_t, e_t)
    bounded: W_U / max(1, sigma_max(W_U))
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from fbt_megatron.model import feedback_rule

ROOT = Path(__file__).resolve().parents[2]
RULE = {name: f for name, f in vars(feedback_rule).items()
        if inspect.isfunction(f) and f.__module__ == feedback_rule.__name__}
D = 8


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------- the functions, against the formulas
def test_token_gate_and_fuse_are_the_formulas():
    g, v = randn(3, 4, D, seed=1), randn(3, 4, D, seed=2)
    glu = feedback_rule.token_gate(g, "glu")
    torch.testing.assert_close(glu, 1.0 / (1.0 + torch.exp(-g)), rtol=0, atol=1e-6)
    assert torch.equal(feedback_rule.token_gate(g, "additive"), g)
    torch.testing.assert_close(feedback_rule.fuse(v, glu, "glu"), v * glu, rtol=0, atol=0)
    torch.testing.assert_close(feedback_rule.fuse(v, g, "additive"), v + g, rtol=0, atol=0)
    one = v[:1, :1]  # a constant state's value (one row) broadcasts to every position
    out = feedback_rule.fuse(one, glu, "glu")
    assert out.shape == glu.shape and torch.equal(out[2, 3], one[0, 0] * glu[2, 3])


@pytest.mark.parametrize("a", [0.0, 0.3])
def test_mix_is_the_prefix_mixin(a):
    h, h0 = randn(5, 2, D, seed=3), randn(D, seed=4)
    torch.testing.assert_close(feedback_rule.mix(h, h0, a), (1 - a) * h + a * h0, rtol=0, atol=1e-7)


@pytest.mark.parametrize("dim", [0, 1])
def test_shift_moves_states_one_position_later_and_resets_to_h_init(dim):
    fed, h0 = randn(4, 5, D, seed=5), randn(D, seed=6)
    reset = torch.zeros(4, 5, dtype=torch.bool)
    reset[2, 3] = True  # a document start (seq 2 of 4 along dim 0, or 3 of 5 along dim 1)
    out = feedback_rule.shifted_states(fed, reset, h0, dim)
    for i in range(4):
        for j in range(5):
            t = (i, j)[dim]
            prev = (i - 1, j) if dim == 0 else (i, j - 1)
            want = h0 if t == 0 or reset[i, j] else fed[prev]
            assert torch.equal(out[i, j], want), (i, j)


@pytest.mark.parametrize("dim", [0, 1])
def test_a_one_token_sequence_receives_h_init(dim):
    """A sequence of one position (a 1-token prompt) has no previous state: it receives h_init."""
    fed, h0 = randn(1, 3, D, seed=13), randn(D, seed=14)
    fed = fed if dim == 0 else fed.transpose(0, 1)  # [1, 3, D] along dim 0, [3, 1, D] along dim 1
    reset = feedback_rule.reset_positions(None, fed.shape[:2], dim, "cpu")
    assert torch.equal(feedback_rule.shifted_states(fed, reset, h0, dim), h0.expand_as(fed))


def test_a_one_token_prompt_runs_every_pass_on_its_embedding():
    """End to end, the HF model: a 1-token prompt has no previous state in any pass, so k passes give
    pass 1's logits (x_0 = e_0 in every pass under the embedding rule)."""
    from fbt_megatron.model import modeling_fbt

    config = modeling_fbt.FBTConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = modeling_fbt.FBTForCausalLM(config).eval()
    ids = torch.tensor([[5], [7]])
    with torch.no_grad():
        one = model(ids, num_passes=1, use_cache=False).logits
        three = model(ids, num_passes=3, use_cache=False).logits
    torch.testing.assert_close(three, one, rtol=0, atol=0)


def test_reset_positions_are_the_first_position_and_document_starts():
    doc = torch.tensor([[0, 0, 1, 0], [0, 1, 0, 1]])
    want = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(feedback_rule.reset_positions(doc, (2, 4), 1, "cpu"), want)
    assert torch.equal(feedback_rule.reset_positions(doc.t(), (4, 2), 0, "cpu"), want.t())
    assert torch.equal(feedback_rule.reset_positions(None, (2, 3), 1, "cpu"),
                       torch.tensor([[1, 0, 0], [1, 0, 0]], dtype=torch.bool))
    # a left-padded batch: each row's first attended position
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(feedback_rule.attended_starts(mask, 1),
                       torch.tensor([[0, 0, 1, 0], [1, 0, 0, 0], [0, 1, 0, 0]], dtype=torch.bool))


def test_bounded_divides_by_the_largest_singular_value_only_above_one():
    q = torch.linalg.qr(randn(D, D, seed=7))[0]
    big = q @ torch.diag(torch.linspace(0.1, 3.0, D)) @ q.T  # sigma_max 3
    small = q @ torch.diag(torch.linspace(0.1, 0.5, D)) @ q.T
    torch.testing.assert_close(feedback_rule.spectral_norm(big), torch.tensor(3.0), rtol=1e-5, atol=0)
    torch.testing.assert_close(feedback_rule.bounded(big, feedback_rule.spectral_norm(big)), big / 3.0,
                               rtol=1e-5, atol=1e-6)
    assert torch.equal(feedback_rule.bounded(small, feedback_rule.spectral_norm(small)), small)


def test_a_bounded_export_reimports_bit_for_bit():
    """The export writes W_U as the bounded mixin applies it; an import of that export applies the bound
    again (the model and a second export): that must leave it unchanged, bit for bit. Divided by sigma
    exactly, rounding leaves sigma a few ulps above 1 for some matrices (12 of 50 here), and the second
    application moved them."""
    from types import SimpleNamespace

    from fbt_megatron.hf.export import as_applied

    bounded = SimpleNamespace(mixin="bounded")
    for seed in range(50):
        w = randn(64, 64, seed=seed) * (1.0 + seed / 10)  # sigma_max about 16-100
        exported = as_applied("feedback.value.weight", w, bounded)
        sigma = feedback_rule.spectral_norm(w)
        torch.testing.assert_close(exported, w / sigma, rtol=4e-6, atol=0)  # the trained model's W_U / sigma
        assert feedback_rule.spectral_norm(exported) <= 1.0, seed
        assert torch.equal(feedback_rule.bounded(exported, feedback_rule.spectral_norm(exported)), exported), seed
        assert torch.equal(as_applied("feedback.value.weight", exported, bounded), exported), seed
    small = randn(8, 8) * 0.01
    assert as_applied("feedback.value.weight", small, bounded) is small
    assert as_applied("feedback.value.weight", w, SimpleNamespace(mixin="affine")) is w


@pytest.mark.parametrize("first_input", ["embedding", "state"])
def test_stack_input_reads_the_stateless_input_where_reset(first_input):
    w_u, h0 = randn(D, D, seed=8), randn(D, seed=9)
    state, emb, gate = randn(2, 5, D, seed=10), randn(2, 5, D, seed=11), torch.sigmoid(randn(2, 5, D, seed=12))

    def fuse(s, g):
        return feedback_rule.fuse(s @ w_u.T, g, "glu")

    reset = torch.tensor([[1, 0, 0, 1, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    out = feedback_rule.stack_input(state, emb, gate, reset, h0, first_input, fuse)
    for b in range(2):
        for t in range(5):
            if not reset[b, t]:
                want = (w_u @ state[b, t]) * gate[b, t]
            else:
                want = emb[b, t] if first_input == "embedding" else (w_u @ h0) * gate[b, t]
            torch.testing.assert_close(out[b, t], want, rtol=1e-6, atol=1e-6)
    flat = feedback_rule.stack_input(state[0], emb[0], gate[0], reset[0], h0, first_input, fuse)  # vLLM's [N, D]
    torch.testing.assert_close(flat, out[0], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------- one rule, three models
def test_the_hf_model_and_the_exporter_hold_the_rules_own_functions():
    """The modelling file imports the rule's functions as a sibling (the objects themselves, not copies) and
    defines none of its own under their names; the exporter writes W_U with the rule's bounded scaling."""
    from fbt_megatron.hf import export
    from fbt_megatron.model import modeling_fbt

    imported = {n for n in RULE if n in vars(modeling_fbt)}
    assert imported >= {"token_gate", "mix", "shifted_states", "fuse", "stack_input", "stateless_input",
                        "reset_positions", "attended_starts"}, imported
    for name in imported:
        assert getattr(modeling_fbt, name) is RULE[name], name
    assert export.feedback_rule is feedback_rule
    assert feedback_rule.__file__ in {str(p) for p in export.REMOTE_CODE}


def test_the_megatron_model_holds_the_rule_module():
    from fbt_megatron.model import fbt_gpt, feedback

    assert feedback.rule is feedback_rule and fbt_gpt.rule is feedback_rule


def _class_methods(path: Path, cls: str) -> set[str]:
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return {n.name for n in node.body if isinstance(n, ast.FunctionDef)}


def test_the_vllm_model_inherits_the_hf_rule_methods():
    """Read from the source (vLLM is not installed here; tests/support/side/vllm_gate_side.py checks the objects in
    vLLM's venv): the plugin's module overrides none of the fusion's methods but ``token_gate`` (the same
    quantity, read from a table of it), and builds the table with the rule's ``token_gate``."""
    source = ROOT / "fbt_megatron" / "serving" / "vllm_model.py"
    own = _class_methods(source, "LatentFeedback")
    rule_methods = _class_methods(ROOT / "fbt_megatron" / "model" / "modeling_fbt.py", "LatentFeedback") - {"__init__"}
    assert own & rule_methods == {"token_gate"}, own & rule_methods
    tree = ast.parse(source.read_text())
    imports = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert ("fbt_megatron.model.feedback_rule", "token_gate") in imports


def _spy(monkeypatch, modules) -> list[str]:
    """Every call of a rule function through ``modules``' references to it, recorded by name."""
    calls = []
    for name, f in RULE.items():
        def spy(*args, _f=f, _name=name, **kwargs):
            calls.append(_name)
            return _f(*args, **kwargs)
        for module in modules:
            if getattr(module, name, None) is f:
                monkeypatch.setattr(module, name, spy)
    return calls


CALLED = {"token_gate", "mix", "shifted_states", "shift", "fuse", "stack_input", "stateless_input",
          "reset_positions"}


@pytest.mark.parametrize("first_input", ["embedding", "state"])
def test_the_megatron_model_runs_the_rule(single_process, monkeypatch, first_input):
    from fbt_megatron.model.fbt_gpt import build_model
    from tests.support.model_helpers import feedback, make_inputs, tiny_model_config

    torch.manual_seed(0)
    model = build_model(tiny_model_config(), feedback(prefix_mixin=0.2, first_input=first_input)).eval()
    ids, _, doc_start = make_inputs()
    calls = _spy(monkeypatch, [feedback_rule])
    with torch.no_grad():
        model(ids, doc_start=doc_start, num_passes=2)
    assert set(calls) >= CALLED, set(calls)


@pytest.mark.parametrize("first_input", ["embedding", "state"])
def test_the_hf_model_runs_the_rule(monkeypatch, first_input):
    from fbt_megatron.model import modeling_fbt

    config = modeling_fbt.FBTConfig(vocab_size=64, hidden_size=D * 4, intermediate_size=48, num_hidden_layers=1,
                                    num_attention_heads=2, max_position_embeddings=32, feedback_prefix_mixin=0.2,
                                    feedback_first_input=first_input)
    torch.manual_seed(0)
    model = modeling_fbt.FBTForCausalLM(config).eval()
    calls = _spy(monkeypatch, [feedback_rule, modeling_fbt])
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids, num_passes=2, use_cache=False)
        mask = torch.ones_like(ids)
        mask[1, :2] = 0  # a left-padded row
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert set(calls) >= CALLED | {"attended_starts"}, set(calls)


def test_save_pretrained_writes_the_rule_beside_the_modelling_file(tmp_path):
    """The package's own FBT classes save with their remote code: the modelling file and the rule it
    imports, both as the package holds them (transformers copies a remote-code file's relative imports)."""
    from fbt_megatron.model import modeling_fbt

    config = modeling_fbt.FBTConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, max_position_embeddings=32)
    modeling_fbt.FBTForCausalLM(config).save_pretrained(tmp_path)
    for name in ("modeling_fbt.py", "feedback_rule.py"):
        assert (tmp_path / name).read_bytes() == (ROOT / "fbt_megatron" / "model" / name).read_bytes(), name
