"""The research tools' building blocks: synthetic task generators and the stability estimators."""

import numpy as np
import pytest
import torch

from fbt_megatron.research.stability import (contraction_ratios, hutchinson_frobenius, power_spectral_norm,
                                             relative_residuals)
from fbt_megatron.research.tasks import completion_task, delayed_memory_task


def test_completion_task_labels_follow_the_counts():
    b = completion_task(np.random.default_rng(0), 8, 50, max_count=4, num_items=8)
    assert b.input_ids.shape == b.labels.shape == (8, 50)
    assert (b.labels[:, :-1] == b.input_ids[:, 1:]).all()  # next-token labels
    for row, done in zip(b.input_ids, b.probes["complete"]):
        remaining = None
        for tok, flag in zip(row, done):
            if 1 <= tok <= 4:  # a count token starts a sub-task
                assert remaining in (None, 0)
                remaining = int(tok)
                assert flag == 0
            else:
                assert tok >= 5 and remaining > 0
                remaining -= 1
                assert flag == int(remaining == 0)
    # a standard model's layer 0 sees only x_t: "is an item" does not determine completion
    items = b.input_ids >= 5
    assert 0 < b.probes["complete"][items].mean() < 1


def test_delayed_memory_task():
    d = 3
    b = delayed_memory_task(np.random.default_rng(1), 4, 20, delay=d, num_symbols=16)
    assert (b.labels[:, d:] == b.input_ids[:, :-d]).all() and (b.loss_mask[:, :d] == 0).all()
    assert (b.probes["recall"][:, d:] == b.input_ids[:, :-d]).all() and (b.probes["recall"][:, :d] == -1).all()
    assert (b.probes["recall_prev"][:, d + 1:] == b.input_ids[:, : -(d + 1)]).all()
    with pytest.raises(ValueError, match="delay"):
        delayed_memory_task(np.random.default_rng(1), 1, 5, delay=5)


def test_power_method_finds_the_spectral_norm_of_a_linear_map():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(40, 40, generator=g, dtype=torch.float64)
    x = torch.randn(40, dtype=torch.float64, generator=g)
    exact = torch.linalg.matrix_norm(a, ord=2).item()
    got = power_spectral_norm(lambda v: a @ v, x, iters=500, tol=1e-12)
    assert got == pytest.approx(exact, rel=1e-6)
    # a contraction: scale to spectral norm 0.5
    got = power_spectral_norm(lambda v: (0.5 / exact) * (a @ v), x, iters=500, tol=1e-12)
    assert got == pytest.approx(0.5, rel=1e-6)


def test_hutchinson_estimates_the_frobenius_norm():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(30, 30, generator=g, dtype=torch.float64)
    got = hutchinson_frobenius(lambda v: a @ v, torch.zeros(30, dtype=torch.float64), samples=2000)
    assert got == pytest.approx(torch.linalg.matrix_norm(a).item(), rel=0.05)


def test_residuals_and_contraction_ratio_of_a_geometric_iteration():
    x_star, v = torch.ones(5, dtype=torch.float64), torch.arange(5, dtype=torch.float64)
    iterates = [x_star + 0.3**k * v for k in range(12)]
    r = relative_residuals(iterates)
    ratios = contraction_ratios(r)
    assert all(abs(c - 0.3) < 1e-3 for c in ratios[8:])  # ratio -> c as x^k -> x*
    assert contraction_ratios([1.0, 0.0, 0.0])[1] is None  # at the floor the ratio is not reported


def test_fixed_point_iteration_is_exact_after_seq_len_passes_and_jacobian_norm_matches(single_process):
    from fbt_megatron.config import FeedbackConfig, ModelConfig
    from fbt_megatron.model.fbt_gpt import build_model
    from fbt_megatron.research.fixed_point import iterate_passes, one_step_jacobian_norms, stack_inputs

    torch.manual_seed(0)
    model = build_model(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                                    max_sequence_length=16), FeedbackConfig(jitter_std=0.0))
    ids = torch.randint(0, 64, (2, 12))
    res = iterate_passes(model, ids, max_passes=20)
    assert len(res["residuals"]) == 19
    assert max(res["residuals"][:5]) > 1e-4  # not converged early (random weights)
    assert max(res["residuals"][12:]) < 1e-6  # exact once k >= S: Jacobi has reached the recurrence
    with torch.no_grad():
        full = model(ids, num_passes=12).hidden
    torch.testing.assert_close(res["top"], full, rtol=1e-5, atol=1e-6)

    # the power-method estimate equals the largest singular value of the full one-step Jacobian
    t = 5
    est = one_step_jacobian_norms(model, ids, res["top"], [t], iters=200)[0]
    fb = model.feedback
    with torch.no_grad():
        emb, mask, rotary, reset = stack_inputs(model, ids[:1])
        states = fb.shift_states(res["top"][:, :1], reset)

    def step(h):
        st = torch.cat([states[:t], fb.fed_back(h).view(1, 1, -1)], 0)
        # the pass input by the formula: e at position 0, (W_U s) * sigmoid(W_G e) elsewhere
        fused = (torch.nn.functional.linear(st, fb.value.weight)
                 * torch.sigmoid(torch.nn.functional.linear(emb[: t + 1], fb.gate.weight)))
        x = torch.where(reset[: t + 1].unsqueeze(-1), emb[: t + 1], fused)
        return model.run_stack(x, mask[..., : t + 1, : t + 1], rotary[: t + 1])[-1, 0]

    jac = torch.autograd.functional.jacobian(step, res["top"][t - 1, 0].detach())
    assert est["spectral_norm"] == pytest.approx(torch.linalg.matrix_norm(jac, ord=2).item(), rel=1e-2)  # float32 central differences
    # Hutchinson with 8 Rademacher probes u (seed 0, as the estimator draws them): sqrt(mean ||J^T u||^2) of
    # the exact Jacobian. (The estimator itself converges to ||J||_F: test_hutchinson_estimates_...)
    g = torch.Generator().manual_seed(0)
    probes = [torch.randint(0, 2, (jac.shape[0],), generator=g).to(jac.dtype) * 2 - 1 for _ in range(8)]
    want = (sum(float((jac.T @ u).pow(2).sum()) for u in probes) / 8) ** 0.5
    assert est["frobenius_norm"] == pytest.approx(want, rel=1e-4)
    assert 0.5 < want / torch.linalg.matrix_norm(jac).item() < 2.0  # 8 probes: near ||J||_F


def test_fused_prefill_problems_are_held_out_and_answers_parse():
    import importlib.util
    from pathlib import Path

    from data_pipeline.embedded import math_documents

    path = Path(__file__).resolve().parents[2] / "tools" / "fused_prefill.py"
    spec = importlib.util.spec_from_file_location("fused_prefill", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    problems = mod.held_out_problems(50)
    assert len(problems) == 50 and all(p.startswith("Question: ") and p.endswith("\nAnswer:") for p, _ in problems)
    assert all(mod.final_answer(a) is not None for _, a in problems)
    train_questions = {part.split("\nAnswer: ")[0] for _, doc in math_documents(20_000, 0) for part in doc.split("\n\n")}
    assert not any(p[: -len("\nAnswer:")] in train_questions for p, _ in problems)  # held out
    assert len({p for p, _ in problems}) == 50  # and distinct
    assert mod.final_answer("so x = 4.\n#### -1,234.") == "-1234"
    assert mod.final_answer("no answer line") is None


def test_sft_math_problems_are_held_out_and_conversations_are_the_training_problems():
    """tools/sft_math.py (issue 22): the measured problems never occur in the SFT conversations nor in the
    pretraining documents (the embedded mix: 20,000 math documents, seed 0); each conversation is one
    worked problem (user: question, assistant: the answer ending in ``#### N``)."""
    from data_pipeline.embedded import math_documents
    from fbt_megatron.research.sft import final_answer, held_out_problems, math_conversations

    convs = math_conversations()
    assert all([m["role"] for m in c["messages"]] == ["user", "assistant"] for c in convs)
    assert all(final_answer(c["messages"][1]["content"]) is not None for c in convs)
    trained = {c["messages"][0]["content"] for c in convs}
    pretrained = {part.split("\nAnswer: ")[0].removeprefix("Question: ")
                  for _, doc in math_documents(20_000, 0) for part in doc.split("\n\n")}
    assert trained == pretrained  # SFT data: the math problems pretraining saw, as conversations
    problems = held_out_problems(50)
    assert len(problems) == 50 and len({q for q, _ in problems}) == 50
    assert not any(q in trained for q, _ in problems)  # held out
    assert all(final_answer(a) is not None for _, a in problems)


def test_sft_results_name_the_command_that_reproduces_them():
    """docs/results/sft.md quotes the command of the run recorded in sft.json, every argument that changes
    the numbers included (it once left out --max-new-tokens 48: re-running it gave 64)."""
    import importlib.util
    import json
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("sft_math", root / "tools" / "sft_math.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    recorded = json.loads((root / "docs" / "results" / "sft.json").read_text())["args"]
    a = mod.parser().parse_args(["run"])
    assert set(vars(a)) - {"cmd", "work", "out", "force"} == set(mod.RESULT_ARGS)
    a.__dict__.update(recorded)
    command = mod.run_command(a)
    again = vars(mod.parser().parse_args(shlex.split(command)[2:]))
    assert {k: again[k] for k in mod.RESULT_ARGS} == {k: recorded[k] for k in mod.RESULT_ARGS}
    assert f"_Produced by `{command}` on " in (root / "docs" / "results" / "sft.md").read_text()
