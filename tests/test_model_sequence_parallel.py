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
from fbt_megatron.testing.distributed import run_distributed
from model_helpers import feedback, load_full_weights, tiny_model_config, unshard


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
    return out


def _all_gather(t):
    parts = [torch.empty_like(t) for _ in range(2)]
    torch.distributed.all_gather(parts, t.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return parts


def test_fusion_sequence_parallel_matches_tensor_parallel():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    full = {"value.weight": torch.randn(32, 32, generator=g) * 0.1, "gate.weight": torch.randn(32, 32, generator=g) * 0.1,
            "initial_state": torch.randn(32, generator=g)}
    for rank_out in run_distributed(fusion_outputs, 2, full, layout=ParallelLayout(tensor=2)):
        plain, sp = rank_out[False], rank_out[True]
        torch.testing.assert_close(sp[0], plain[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sp[1], plain[1], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sp[2], plain[2], rtol=1e-6, atol=1e-6)
        for name in plain[3]:
            if plain[3][name] is not None:
                torch.testing.assert_close(sp[3][name], plain[3][name], rtol=1e-6, atol=1e-6)
