"""Tensor parallelism changes the layout, not the math: TP=2 equals TP=1 from the same weights,
for the GPT-2-style default block and for the Llama-shaped one (SwiGLU, RMSNorm, GQA, no biases,
untied embeddings, a vocabulary padded differently at TP=1 and TP=2)."""

import itertools

import pytest
import torch

from fbt_megatron.model import tp_layout
from fbt_megatron.model.fbt_gpt import build_model
from fbt_megatron.runtime import ParallelLayout
from tests.support.distributed import run_distributed
from tests.support.model_helpers import LLAMA, TINY, feedback, gathered_logits, load_full_weights, make_inputs, unshard

from fbt_megatron.config import ModelConfig

CASES = list(itertools.product((1, 2, 3), ("all", "last")))
JITTER_SEED = 77


ARCHS = {"gpt": TINY, "llama": LLAMA}


def cases_for(loss_on):
    # loss_on="mean" with grad_mode="last" is refused by FeedbackConfig (test_model_gradients.py).
    return [(k, mode) for k, mode in CASES if not (loss_on == "mean" and mode == "last")]


def run_cases(full_state, loss_on="last", arch="gpt", fb=None):
    """On every rank: logits and full (unsharded) parameter gradients for each (k, grad_mode)."""
    ids, labels, doc_start = make_inputs()
    cfg = ModelConfig(**ARCHS[arch])
    results = {}
    for k, mode in cases_for(loss_on):
        torch.manual_seed(0)
        model = build_model(cfg, feedback(grad_mode=mode, loss_on=loss_on, **(fb or {})))
        load_full_weights(model, full_state)
        model.train()  # jitter on (seeded), dropout is 0
        out = model(ids, doc_start=doc_start, labels=labels, num_passes=k, jitter_seed=JITTER_SEED)
        out.token_loss.sum().backward()
        # None: the parameter took no part (the fusion in a 1-pass forward)
        grads = {n: None if p.grad is None else unshard(p.grad, p, n, model) for n, p in model.named_parameters()}
        pad = model._padding_columns  # this rank's padded vocabulary rows: no gradient reaches them
        padding_grad = 0.0 if pad is None else max(
            float(p.grad[pad].abs().max()) for n, p in model.named_parameters() if n.endswith(("word_embeddings.weight", "output_layer.weight")))
        with torch.no_grad():
            logits = gathered_logits(model(ids, doc_start=doc_start, num_passes=k, jitter_seed=JITTER_SEED).logits.transpose(0, 1)).transpose(0, 1)
        assert torch.isneginf(logits[..., cfg.vocab_size:]).all()  # padded columns never get probability
        results[(k, mode)] = {"logits": logits[..., :cfg.vocab_size], "loss": out.token_loss.detach(), "grads": grads,
                              "padding_grad": padding_grad}
    results["layout"] = tp_sharding(model)
    return results


def tp_sharding(model) -> dict:
    """This rank's TP rank and size, and the parameters it holds only a 1/TP slice of (full tensor from
    every rank's slice vs the local one)."""
    from megatron.core import parallel_state as ps

    return {"tp": (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
            "sliced": sorted(n for n, p in model.named_parameters()
                             if unshard(p.detach(), p, n, model).numel() > p.numel())}


# The bounded mixin with W_U = 3 I: its spectral norm is summed over the TP ranks' rows, forward and backward.
BOUNDED = {"mixin": "bounded", "value_init_scale": 3.0}


@pytest.mark.parametrize("arch,loss_on,fb", [("gpt", "last", None), ("gpt", "mean", None), ("llama", "last", None),
                                             ("gpt", "last", BOUNDED)], ids=["gpt-last", "gpt-mean", "llama-last",
                                                                             "gpt-last-bounded"])
def test_tp2_equals_tp1_logits_and_every_gradient(single_process, arch, loss_on, fb):
    torch.manual_seed(0)
    reference_model = build_model(ModelConfig(**ARCHS[arch]), feedback(**(fb or {})))
    full_state = {n: tp_layout.to_full(n, p.detach().clone(), p, reference_model)
                  for n, p in reference_model.named_parameters()}
    expected = run_cases(full_state, loss_on, arch, fb)

    per_rank = run_distributed(run_cases, 2, full_state, loss_on, arch, fb, layout=ParallelLayout(tensor=2))
    # The TP=2 side is sharded: attention, MLP, the embedding and both fusion linears hold a slice each
    # (Llama's vocabulary is padded to 128 rows at TP=1 and 256 at TP=2: each rank's 128 include padding).
    assert expected["layout"] == {"tp": (0, 1), "sliced": []}
    for rank, got in enumerate(per_rank):
        assert got["layout"]["tp"] == (rank, 2)
        sliced = got["layout"]["sliced"]
        for part in ("linear_qkv.weight", "linear_fc1.weight", "linear_fc2.weight", "linear_proj.weight",
                     "feedback.value.weight", "feedback.gate.weight") + (("word_embeddings.weight",) * (arch == "gpt")):
            assert any(n.endswith(part) for n in sliced), (part, sliced)
        for case in cases_for(loss_on):
            exp, res = expected[case], got[case]
            torch.testing.assert_close(res["logits"], exp["logits"], rtol=1e-5, atol=1e-5, msg=f"logits {case} rank {rank}")
            torch.testing.assert_close(res["loss"], exp["loss"], rtol=1e-5, atol=1e-5)
            assert res["grads"].keys() == exp["grads"].keys()
            assert res["padding_grad"] == 0.0 and exp["padding_grad"] == 0.0
            for name in exp["grads"]:
                torch.testing.assert_close(
                    res["grads"][name], exp["grads"][name], rtol=1e-5, atol=1e-5,
                    msg=lambda m, n=name: f"grad {n} {case} rank {rank}: {m}",
                )
    # The cases are not trivially equal to each other: passes and modes change the gradients.
    assert not torch.allclose(expected[(1, "all")]["loss"], expected[(3, "all")]["loss"])
    if loss_on == "last":
        assert not torch.allclose(expected[(3, "all")]["grads"]["feedback.value.weight"],
                                  expected[(3, "last")]["grads"]["feedback.value.weight"])
