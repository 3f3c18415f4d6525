"""The fusion's sequence-parallel path (GPU layout) computes the same as the plain TP path.

The full model cannot run sequence parallelism on CPU (Megatron refuses it with torch norms), but
the fusion's own redistribution (all-to-all to the sequence-parallel layout, split-not-reduce
gradients) runs over gloo, so it is checked here.
"""

from dataclasses import replace

import torch
from megatron.core import parallel_state

from fbt_megatron.model.feedback import LatentFeedback
from fbt_megatron.model.fbt_gpt import transformer_config
from fbt_megatron.runtime import ParallelLayout
from tests.support.distributed import run_distributed
from tests.support.model_helpers import feedback, load_full_weights, tiny_model_config, unshard


def fusion_outputs(full_weights):
    base = transformer_config(tiny_model_config())
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(3)
    state, emb, upstream = (torch.randn(8, 2, 32, generator=g) for _ in range(3))
    out = {}
    for sp in (False, True):
        fusion = LatentFeedback(replace(base, sequence_parallel=sp), feedback())
        load_full_weights(fusion, full_weights)
        s, e = state.clone().requires_grad_(), emb.clone().requires_grad_()
        x = fusion(s, e)
        target = upstream.chunk(2, dim=0)[tp_rank] if sp else upstream
        (x * target).sum().backward()
        full_x = torch.cat(_all_gather(x), dim=0) if sp else x
        out[sp] = (full_x.detach(), s.grad, e.grad, {n: unshard(p.grad, p) for n, p in fusion.named_parameters()})
        # a later pass's input: the stack's layout is this rank's sequence chunk under SP, whose document
        # starts (one in each rank's chunk) read the embedding
        reset = torch.zeros(8, 2, dtype=torch.bool)
        reset[0], reset[2, 1], reset[5, 0] = True, True, True
        fusion.eval()  # (no jitter)
        with torch.no_grad():
            local_emb = emb.chunk(2, dim=0)[tp_rank] if sp else emb
            x = fusion.pass_input(state, local_emb, fusion.token_gate(emb), reset)
        out["pass_input", sp] = torch.cat(_all_gather(x), dim=0) if sp else x
    return out


def _all_gather(t):
    parts = [torch.empty_like(t) for _ in range(2)]
    torch.distributed.all_gather(parts, t.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return parts


def test_fusion_sequence_parallel_matches_tensor_parallel():
    """The fusion and a later pass's input (its document starts included) under sequence parallelism equal
    plain TP=2: outputs, input gradients and every weight gradient."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    full = {"value.weight": torch.randn(32, 32, generator=g) * 0.1, "gate.weight": torch.randn(32, 32, generator=g) * 0.1,
            "initial_state": torch.randn(32, generator=g)}
    for rank_out in run_distributed(fusion_outputs, 2, full, layout=ParallelLayout(tensor=2)):
        plain, sp = rank_out[False], rank_out[True]
        torch.testing.assert_close(sp[0], plain[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rank_out["pass_input", True], rank_out["pass_input", False], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sp[1], plain[1], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sp[2], plain[2], rtol=1e-6, atol=1e-6)
        for name in plain[3]:
            if plain[3][name] is not None:
                torch.testing.assert_close(sp[3][name], plain[3][name], rtol=1e-6, atol=1e-6)


def packed_model_outputs(full_state):
    """TP=2, packed documents (the CPU emulation of TE's THD path), with and without sequence parallelism:
    the loss, the top states and every parameter's full gradient (sequence-parallel norm gradients summed
    over TP, as the engine does)."""
    from fbt_megatron.config import ModelConfig
    from fbt_megatron.model.fbt_gpt import build_model
    from tests.support.model_helpers import LLAMA, make_inputs

    ids, labels, doc_start = make_inputs(seq=10)
    out = {}
    for sp in (False, True):
        torch.manual_seed(0)
        model = build_model(ModelConfig(**LLAMA), feedback(), sequence_parallel=sp, packed=True).train()
        assert model.packed and model.config.sequence_parallel == sp
        load_full_weights(model, full_state)
        result = model(ids, doc_start=doc_start, labels=labels, num_passes=3, jitter_seed=5)  # jitter on
        result.token_loss.sum().backward()
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad
            if getattr(p, "sequence_parallel", False):
                g = g.clone()
                torch.distributed.all_reduce(g, group=parallel_state.get_tensor_model_parallel_group())
            grads[name] = unshard(g, p, name, model)
        with torch.no_grad():  # no labels (generation, evaluation): the logits
            logits = model.eval()(ids, doc_start=doc_start, num_passes=3).logits
        out[sp] = (result.token_loss.detach(), result.hidden.detach(), grads, logits)
        torch.manual_seed(0)  # the standard model (no fusion) through the same path: its loss
        plain = build_model(ModelConfig(**LLAMA), feedback(fusion="off"), sequence_parallel=sp, packed=True)
        load_full_weights(plain, full_state)  # the feedback model's weights, less the fusion's
        out["standard", sp] = plain(ids, doc_start=doc_start, labels=labels, num_passes=1).token_loss.detach()
    return out


def test_packed_attention_under_sequence_parallelism_matches_tensor_parallel(single_process):
    """Under sequence parallelism the packed (THD) path stays on (no dense S x S scores): the rows are
    laid end to end as one row so each rank's sequence chunk is a contiguous share of the packed tokens.
    Loss, top states, gradients and (without labels) logits equal TP=2 without it; so does a standard model's
    loss (no fusion) through the same path."""
    from fbt_megatron.config import ModelConfig
    from fbt_megatron.model import tp_layout
    from fbt_megatron.model.fbt_gpt import build_model
    from tests.support.model_helpers import LLAMA

    torch.manual_seed(0)
    reference = build_model(ModelConfig(**LLAMA), feedback(), packed=True)
    full = {n: tp_layout.to_full(n, p.detach().clone(), p, reference) for n, p in reference.named_parameters()}
    ids_shape = (2, 10)  # packed_model_outputs' make_inputs(seq=10)
    padded_vocab = reference.gpt.output_layer.weight.shape[0]  # one rank: the whole padded vocabulary
    for rank_out in run_distributed(packed_model_outputs, 2, full, layout=ParallelLayout(tensor=2)):
        (loss0, hidden0, grads0, logits0), (loss1, hidden1, grads1, logits1) = rank_out[False], rank_out[True]
        torch.testing.assert_close(loss1, loss0, rtol=0, atol=1e-5)
        assert logits0.shape == (*ids_shape, padded_vocab)  # gathered over TP: the whole padded vocabulary
        torch.testing.assert_close(logits1, logits0, rtol=0, atol=1e-5)
        torch.testing.assert_close(rank_out["standard", True], rank_out["standard", False], rtol=0, atol=1e-5)
        torch.testing.assert_close(hidden1, hidden0, rtol=0, atol=1e-5)
        assert grads1.keys() == grads0.keys()
        for name in grads0:
            err = (grads1[name] - grads0[name]).abs().max() / grads0[name].abs().max().clamp_min(1.0)
            assert err <= 1e-5, (name, float(err))
