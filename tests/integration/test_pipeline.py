"""Pipeline parallelism changes where layers run, not the math: PP=2 (and PP=2 x TP=2) equals PP=1
from the same weights — loss, gradient norm and every parameter's gradient — for k = 1, 2, 3 passes,
both gradient modes and both loss modes, with 4 micro-batches in flight."""

import re

import pytest
import torch

from fbt_megatron.model.fbt_gpt import build_model
from fbt_megatron.parallel.pipeline_runner import PipelineRunner
from fbt_megatron.parallel.schedule import (BACKWARD, FORWARD, Op, build_schedule, grad_passes_for,
                                            theoretical_bubble)
from fbt_megatron.runtime import ParallelLayout
from fbt_megatron.engine import Engine
from tests.support.distributed import run_distributed
from tests.support.model_helpers import feedback, shard, tiny_model_config, unshard

# (passes, grad_mode, loss_on): every k with both gradient modes; both loss modes among them
# (loss_on="mean" with grad_mode="last" is refused by FeedbackConfig).
CASES = [(1, "all", "last"), (1, "last", "last"), (2, "all", "mean"), (2, "last", "last"),
         (3, "all", "last"), (3, "last", "last"), (3, "all", "mean")]
MICRO_BATCHES = 4
TOL = 1e-5
MODEL = dict(num_layers=4, vocab_pad_multiple=32)  # 2 layers per stage; 64 rows at TP 1 and 2 (no padding)


def micro_batches(n=MICRO_BATCHES, batch=2, seq=10, vocab=64):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        doc_start = torch.rand(batch, seq, generator=g) < 0.15
        out.append({"input_ids": ids, "position_ids": torch.arange(seq).expand(batch, -1),
                    "doc_start": doc_start, "labels": torch.randint(0, vocab, (batch, seq), generator=g),
                    "loss_mask": (torch.rand(batch, seq, generator=g) < 0.9).float()})
    return out


def global_name(model, name: str) -> str:
    """The PP=1 parameter name of a stage's parameter (global layer number; the last stage's tied
    output weight is the word embedding)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if name == "gpt.output_layer.weight" and model.model_config.tie_embeddings:
        return "gpt.embedding.word_embeddings.weight"
    offset = get_transformer_layer_offset(model.config, None, ps.get_pipeline_model_parallel_rank())
    return re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)


def case_model(full_state, mode, loss_on, local_value, packed=False, sequence_parallel=False):
    """The case's model (this rank's part), its parameters filled by ``local_value(model, name, p)``;
    ``packed``: the packed-sequence (THD, cu_seqlens) attention the GPU runs, emulated on CPU."""
    model = build_model(tiny_model_config(**MODEL), feedback(grad_mode=mode, loss_on=loss_on), packed=packed,
                        sequence_parallel=sequence_parallel)
    assert model.packed == packed
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(local_value(model, n, p))
    return model.train()


def whole_model_reference(full_state, cases):
    """PP=1 in this process: per case, the loss, gradient norm and full gradients."""
    import torch.distributed as dist

    mbs = micro_batches()
    tokens = sum(b["loss_mask"].sum() for b in mbs)
    results = {}
    sizes = []  # elements of every tensor this rank sends or receives point to point
    real_batch = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: sizes.extend(op.tensor.numel() for op in ops) or real_batch(ops)
    for k, mode, loss_on in cases:
        model = case_model(full_state, mode, loss_on, lambda model, n, p: full_state[n])
        loss = 0.0
        for i, b in enumerate(mbs):
            out = model(b["input_ids"], b["position_ids"], b["doc_start"], b["labels"], num_passes=k,
                        jitter_seed=100 + i)
            tok = (out.token_loss.float() * b["loss_mask"]).sum()
            (tok / tokens).backward()
            loss += float(tok.detach())
        # None: the parameter took no part (the fusion in a 1-pass step)
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values() if g is not None)))
        results[(k, mode, loss_on)] = {"loss": loss / float(tokens), "norm": norm, "grads": grads}
    return results


def pipelined(full_state, cases, packed=False, sequence_parallel=False):
    """PP>1 on this rank: per case, loss, gradient norm (each parameter once over PP and TP) and
    the full (TP-unsharded) gradients of this stage's parameters under their PP=1 names."""
    from fbt_megatron.engine import model_parallel_grad_norm

    import torch.distributed as dist

    mbs = micro_batches()
    tokens = sum(b["loss_mask"].sum() for b in mbs)
    results = {}
    sizes = []  # elements of every tensor this rank sends or receives point to point
    real_batch = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: sizes.extend(op.tensor.numel() for op in ops) or real_batch(ops)
    for k, mode, loss_on in cases:
        model = case_model(full_state, mode, loss_on, lambda model, n, p: shard(full_state[global_name(model, n)], p),
                           packed=packed, sequence_parallel=sequence_parallel)
        gate_calls = []  # first stage: W_G e once per micro-batch, not once per pass (never for 1 pass)
        if model.feedback is not None:
            model.feedback.gate.register_forward_hook(lambda *a: gate_calls.append(1))
        runner = PipelineRunner(model)
        Engine._mark_pipeline_replicas(model)  # what the training engine marks (counted once in the norm)
        marked = [n for n, p in model.named_parameters() if getattr(p, "ds_pipe_replicated", False)]
        out = runner.run(mbs, k, training=True, scale=1.0 / float(tokens),
                         jitter_seeds=[100 + i for i in range(len(mbs))])
        if sequence_parallel:  # norms see a chunk of the sequence each: summed over TP, as the engine does
            from megatron.core import parallel_state as ps

            from fbt_megatron.engine.sequence_parallel_grads import (reduce_sequence_parallel_grads,
                                                                     sequence_parallel_params)

            reduce_sequence_parallel_grads(sequence_parallel_params(model), ps.get_tensor_model_parallel_group())
        grads = {global_name(model, n): None if p.grad is None else unshard(p.grad, p)
                 for n, p in model.named_parameters()}
        results[(k, mode, loss_on)] = {"loss": float(out.loss_sum) / float(tokens), "grads": grads,
                                       "norm": model_parallel_grad_norm(list(model.parameters())),
                                       "gate_calls": len(gate_calls) if model.feedback is not None else None,
                                       "layout": stage_layout(model), "marked": marked}
    dist.batch_isend_irecv = real_batch
    results["message_sizes"] = sorted(set(sizes))
    return results


def stage_layout(model) -> dict:
    """What this rank runs: its PP/TP ranks and sizes, its global layer numbers, and how many of its
    parameters are TP shards (their full tensor is TP times larger)."""
    from megatron.core import parallel_state as ps

    return {"pp": (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()),
            "tp": (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
            "layers": sorted({int(m.group(1)) for n, _ in model.named_parameters()
                              if (m := re.search(r"decoder\.layers\.(\d+)\.", global_name(model, n)))}),
            "tp_shards": sum(int(unshard(p.detach(), p).numel() > p.numel()) for p in model.parameters()),
            "first": model.gpt.pre_process, "last": model.gpt.post_process}


def check_layout(per_rank, tp: int):
    """Every rank ran the pipeline it claims: 2 stages of 2 layers each (first: layers 0-1, the embedding
    and the fusion; last: layers 2-3 and the head; its tied head weight marked as the replica), TP=tp."""
    firsts = [next(iter(got.values())) for got in per_rank]
    layouts = [first["layout"] for first in firsts]
    assert sorted(lay["pp"] for lay in layouts) == sorted((r, 2) for r in range(2) for _ in range(tp))
    assert sorted(lay["tp"] for lay in layouts) == sorted((r, tp) for r in range(tp) for _ in range(2))
    for lay, first in zip(layouts, firsts):
        stage = lay["pp"][0]
        assert lay["layers"] == [2 * stage, 2 * stage + 1] and (lay["first"], lay["last"]) == (stage == 0, stage == 1)
        assert (lay["tp_shards"] > 0) == (tp > 1), lay
        assert first["marked"] == ([] if stage == 0 else ["gpt.output_layer.weight"]), first["marked"]


@pytest.fixture(scope="module")
def full_state_and_reference():
    from fbt_megatron import runtime

    runtime.init_distributed()
    runtime.init_parallel_state(runtime.ParallelLayout(), seed=1234)
    try:
        model = build_model(tiny_model_config(**MODEL), feedback())
        full_state = {n: p.detach().clone() for n, p in model.named_parameters()}
        reference = whole_model_reference(full_state, CASES)
    finally:
        runtime.shutdown()
    return full_state, reference


def check(reference, per_rank, cases):
    for case in cases:
        exp = reference[case]
        seen = set()
        for rank, got in enumerate(per_rank):
            res = got[case]
            assert abs(res["loss"] - exp["loss"]) < TOL, (case, rank, res["loss"], exp["loss"])
            assert abs(res["norm"] - exp["norm"]) < TOL, (case, rank, res["norm"], exp["norm"])
            assert res["gate_calls"] in (None, MICRO_BATCHES if case[0] > 1 else 0), (case, rank, res["gate_calls"])
            for name, grad in res["grads"].items():
                if exp["grads"][name] is None:  # untouched in the whole model: untouched on its stage
                    assert grad is None, (name, case, rank)
                    seen.add(name)
                    continue
                torch.testing.assert_close(grad, exp["grads"][name], rtol=TOL, atol=TOL,
                                           msg=lambda m, n=name: f"grad {n} {case} rank {rank}: {m}")
                seen.add(name)
        assert seen == set(exp["grads"]), f"{case}: parameters no stage holds: {set(exp['grads']) - seen}"
    # the cases differ from each other: the comparison is not between equal numbers
    assert abs(reference[(3, "all", "last")]["norm"] - reference[(3, "last", "last")]["norm"]) > 1e-4


def test_pp2_equals_pp1(full_state_and_reference):
    full_state, reference = full_state_and_reference
    per_rank = run_distributed(pipelined, 2, full_state, CASES, layout=ParallelLayout(pipeline=2))
    check_layout(per_rank, tp=1)
    check(reference, per_rank, CASES)
    assert all(r["message_sizes"] == [10 * 2 * 32] for r in per_rank)  # [S, B, D] whole


def test_pp2_tp2_equals_pp1(full_state_and_reference):
    full_state, reference = full_state_and_reference
    cases = [(3, "all", "mean")]
    per_rank = run_distributed(pipelined, 4, full_state, cases, layout=ParallelLayout(tensor=2, pipeline=2))
    check_layout(per_rank, tp=2)
    check(reference, per_rank, cases)
    # each TP rank sends and receives its half of [S, B, D] (Megatron's scatter/gather over TP)
    assert all(r["message_sizes"] == [10 * 2 * 32 // 2] for r in per_rank), [r["message_sizes"] for r in per_rank]


@pytest.mark.parametrize("packed", [False, True], ids=["mask", "packed"])
def test_pp2_tp2_sequence_parallel_equals_pp1(full_state_and_reference, packed):
    """TP=2 with sequence parallelism and PP=2 (the layout large models use): the stages exchange each TP
    rank's [S/TP, B, D] chunk, the first stage gathers the fed-back state for the fusion; with packed
    documents each micro-batch's rows run as one row. Equals PP=1 (3 passes, loss mean)."""
    full_state, reference = full_state_and_reference
    cases = [(3, "all", "mean")]
    per_rank = run_distributed(pipelined, 4, full_state, cases, packed, True, layout=ParallelLayout(tensor=2, pipeline=2))
    check_layout(per_rank, tp=2)
    check(reference, per_rank, cases)
    chunk = (10 * 2 if packed else 10) // 2 * (1 if packed else 2) * 32  # [S/TP, B, D]; packed: [B*S/TP, 1, D]
    assert all(r["message_sizes"] == [chunk] for r in per_rank), [r["message_sizes"] for r in per_rank]


def test_pp2_packed_sequences_equal_pp1_mask_path(full_state_and_reference):
    """The pipeline stages with packed sequences (what TE runs on GPU: rows end to end, cu_seqlens from
    doc_start, per-document RoPE; here each document attended alone by SDPA) equal the whole model with
    the dense document mask: the packed layout is built on every stage from the batch's doc_start."""
    full_state, reference = full_state_and_reference
    cases = [(1, "all", "last"), (3, "all", "last"), (3, "last", "last")]
    per_rank = run_distributed(pipelined, 2, full_state, cases, True, layout=ParallelLayout(pipeline=2))
    check_layout(per_rank, tp=1)
    check(reference, per_rank, cases)


# ---------------------------------------------------------------------- the schedule itself
@pytest.mark.parametrize("stages,m,k,mode", [(2, 4, 2, "all"), (2, 4, 3, "last"), (4, 8, 3, "all"),
                                            (3, 2, 2, "all"), (2, 1, 1, "all")])
def test_schedule_is_valid_and_full(stages, m, k, mode):
    grad = grad_passes_for(k, mode, True)
    s = build_schedule(stages, m, k, grad)
    for stage in range(stages):
        ops = s.ops[stage]
        expected = {Op(FORWARD, b, j) for b in range(m) for j in range(k)} | {Op(BACKWARD, b, j) for b in range(m) for j in grad}
        assert sorted(ops) == sorted(expected)
        for op in ops:  # every dependency finished before the op started
            if op.kind == FORWARD and stage > 0:
                assert s.finish[(stage - 1, op)] <= s.start[(stage, op)]
            if op.kind == FORWARD and stage == 0 and op.pass_index > 0:
                assert s.finish[(stages - 1, Op(FORWARD, op.micro_batch, op.pass_index - 1))] <= s.start[(stage, op)]
            if op.kind == BACKWARD and stage < stages - 1:
                assert s.finish[(stage + 1, op)] <= s.start[(stage, op)]
    if m >= stages:  # the ring is full except one ramp: the closed form holds
        worst = max(s.bubble(st) for st in range(stages))
        assert worst == pytest.approx(theoretical_bubble(stages, m, k, mode), abs=1e-9)


# ---------------------------------------------------------------------- pass 1 is the plain GPT, pipelined
def pass_one_fbt_and_plain(full_state):
    """On this rank of PP=2: a 1-pass training step of the FBT model and of the fusion-off model on
    the same weights: (loss, grads) of each, under their PP=1 names."""
    mbs = micro_batches()
    tokens = sum(b["loss_mask"].sum() for b in mbs)
    out = {}
    for fusion in ("glu", "off"):
        model = build_model(tiny_model_config(**MODEL), feedback(fusion=fusion))
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(shard(full_state[global_name(model, n)], p))
        runner = PipelineRunner(model.train())
        if runner.tied and not runner.first:
            runner.shared_weight().ds_pipe_replicated = True
        step = runner.run(mbs, 1, training=True, scale=1.0 / float(tokens),
                          jitter_seeds=[100 + i for i in range(len(mbs))])
        out[fusion] = (step.loss_sum.clone(), {global_name(model, n): None if p.grad is None else p.grad.clone()
                                                 for n, p in model.named_parameters()})
    return out


def test_pp2_pass_one_is_the_plain_gpt_bitwise(full_state_and_reference):
    full_state, _ = full_state_and_reference
    for rank, res in enumerate(run_distributed(pass_one_fbt_and_plain, 2, full_state,
                                               layout=ParallelLayout(pipeline=2))):
        (fbt_loss, fbt_grads), (plain_loss, plain_grads) = res["glu"], res["off"]
        assert torch.equal(fbt_loss, plain_loss), rank
        for name, grad in fbt_grads.items():
            if name.startswith("feedback."):
                assert grad is None, (rank, name)  # the fusion took no part
            else:
                assert torch.equal(grad, plain_grads[name]), (rank, name)
        assert set(plain_grads) == {n for n in fbt_grads if not n.startswith("feedback.")}
