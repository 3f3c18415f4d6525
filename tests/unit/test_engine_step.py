"""The engine's step around DeepSpeed (fbt_megatron/engine/engine.py): the gradient norm and what a
one-rank data-parallel group skips.

References are the formulas: the norm is sqrt(sum of squares) over every gradient element in float64;
the update with DeepSpeed's gradient all-reduce switched back on is what the skip must reproduce; every
optimiser call moves parameters and moments as decoupled AdamW written out in float64."""

import pytest
import torch

from fbt_megatron.engine.engine import NORM_CHUNK_ELEMENTS, squared_l2


def test_squared_l2_is_the_sum_of_squares_in_float64():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(3 * NORM_CHUNK_ELEMENTS + 17, generator=g) * 1e-3  # several pieces and a remainder
    matrix = torch.randn(700, 300, generator=g)
    strided = matrix.t()  # a non-contiguous gradient
    for t in (big, matrix, strided, torch.randn(5, generator=g), torch.zeros(0)):
        reference = sum(float(x) ** 2 for x in t.double().reshape(-1)) if t.numel() < 10 else \
            float((t.double() ** 2).sum())
        got = squared_l2(t)
        assert got.dtype == torch.float64
        # float64 sums of up to ~2·10^5 positive terms, in another order than the reference's (which
        # depends on torch's thread count): within 1e-12 relative; a float32 accumulation is ~1e-7 off.
        assert abs(float(got) - reference) <= 1e-12 * max(reference, 1e-300)


class OneThenTwoPasses:  # the fusion takes no part in step 1: its gradients are missing there
    def num_passes(self, step):
        return 1 if step == 1 else 2


def _engine(tmp_path, **sections):
    """(recipe, Engine) of the tiny recipe with ``sections``, at DP=1, model initialised from seed 0."""
    from fbt_megatron import runtime
    from fbt_megatron.engine import Engine
    from fbt_megatron.model.fbt_gpt import build_model
    from fbt_megatron.recipe import load_recipe
    from tests.support.training import tiny_recipe

    recipe = load_recipe(data=tiny_recipe(tmp_path, **sections))
    runtime.init_parallel_state(runtime.ParallelLayout(), seed=recipe.seed)
    torch.manual_seed(0)
    return recipe, Engine(build_model(recipe.model, recipe.feedback), recipe)


def _train(recipe, engine, steps: int = 3, schedule=None) -> list:
    """``steps`` optimiser steps of FBTTrainStep (1 pass, then 2, unless ``schedule``) on the recipe's data;
    their results."""
    from fbt_megatron import runtime
    from fbt_megatron.data.loaders import build_train_loader
    from fbt_megatron.parallel.runner import get_runner
    from fbt_megatron.train.train_step import FBTTrainStep

    step = FBTTrainStep(engine, get_runner(engine.model, engine), schedule or OneThenTwoPasses(), recipe.seed,
                        runtime.device())
    it = iter(build_train_loader(recipe, 0, 1, 0))
    return [step(i + 1, [next(it) for _ in range(recipe.accumulation_steps(1))], 3e-3) for i in range(steps)]


def _steps(single_process, tmp_path, force_allreduce: bool, monkeypatch):
    # grad_clip far below the gradient norm: the clipping coefficient (from the norm) shapes every update
    recipe, engine = _engine(tmp_path, optimizer={"lr": 3e-3, "grad_clip": 0.05})
    assert engine.ds.enable_backward_allreduce is False  # DP=1, ZeRO-0, fp32
    if force_allreduce:
        engine.ds.enable_backward_allreduce = True
    missing = []  # parameters without a gradient after DeepSpeed's backward, before any zero-fill
    real_backward = engine.ds.backward

    def backward(*a, **k):
        out = real_backward(*a, **k)
        missing.append(sum(p.grad is None for p in engine.ds.module.parameters() if p.requires_grad))
        return out

    monkeypatch.setattr(engine.ds, "backward", backward)
    calls = []
    real = engine.ds.allreduce_gradients
    monkeypatch.setattr(engine.ds, "allreduce_gradients", lambda *a, **k: calls.append(1) or real(*a, **k))
    norms = [r.grad_norm for r in _train(recipe, engine)]
    opt = engine.torch_optimizer
    state = {n: (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
             for n, p in engine.model.named_parameters()}
    if not force_allreduce:
        assert missing[0] > 0, "step 1 left no gradient missing: the zero-fill was not exercised"
    return state, norms, len(calls)


def test_one_rank_zero0_skips_deepspeeds_all_reduce_and_updates_alike(single_process, tmp_path, monkeypatch):
    """DP=1 at ZeRO-0: DeepSpeed's flatten / all-reduce / copy-back of every gradient is an identity,
    skipped, and its zero-fill of the gradients a step did not reach (the fusion in a 1-pass step) kept;
    a 1-pass then two 2-pass clipped AdamW steps give the same parameters, moments and Adam step
    counts bit for bit as with it switched on."""
    skipped, skipped_norms, skipped_calls = _steps(single_process, tmp_path / "a", False, monkeypatch)
    reduced, reduced_norms, reduced_calls = _steps(single_process, tmp_path / "b", True, monkeypatch)
    assert skipped_calls == 0 and reduced_calls >= 3
    assert all(n > 0.05 for n in skipped_norms)  # clipping was active
    assert skipped_norms == reduced_norms
    assert skipped.keys() == reduced.keys()
    for name in skipped:
        (p, state), (p_ref, state_ref) = skipped[name], reduced[name]
        assert torch.equal(p, p_ref), name
        assert state.keys() == state_ref.keys() and all(torch.equal(state[k], state_ref[k]) for k in state), name


@pytest.mark.parametrize("zero", [1, 2])
def test_other_stages_keep_deepspeeds_reduction(single_process, tmp_path, zero):
    _, engine = _engine(tmp_path, parallel={"zero_stage": zero})
    assert engine.ds.enable_backward_allreduce is True


def _zero_state(engine):
    """The model's parameters by name, and the inner optimiser's (flat) parameters with their moments."""
    opt = engine.torch_optimizer
    flat = [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
            for group in opt.param_groups for p in group["params"]]
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}, flat


def _assert_same_update(ours, theirs):
    """Bit for bit the same model parameters, flat partitions and moments (``_zero_state``'s two)."""
    assert ours[0].keys() == theirs[0].keys()
    for name in ours[0]:
        assert torch.equal(ours[0][name], theirs[0][name]), name
    assert len(ours[1]) == len(theirs[1]) > 0
    for (p, state), (p_ref, state_ref) in zip(ours[1], theirs[1]):
        assert torch.equal(p, p_ref)
        assert state.keys() == state_ref.keys() and all(torch.equal(state[k], state_ref[k]) for k in state)


def _zero_steps(tmp_path, zero: int, deepspeeds_reduction: bool, monkeypatch):
    """Three clipped steps (1, 2, 2 passes) at DP=1 and ZeRO-``zero``; the model's parameters, the inner
    optimiser's (flat) parameters and moments, the gradient norms and how many all-reduces DeepSpeed's
    bucket reduction issued."""
    from deepspeed import comm as dist

    recipe, engine = _engine(tmp_path, parallel={"zero_stage": zero}, optimizer={"lr": 3e-3, "grad_clip": 0.05})
    assert "zero_one_rank_reduce" in engine.cpu_fastpaths
    if deepspeeds_reduction:
        del engine.ds.optimizer.allreduce_and_copy  # the class's method again
    calls = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *a, **k: calls.append(tensor.numel()) or real(tensor, *a, **k))
    norms = [r.grad_norm for r in _train(recipe, engine)]
    monkeypatch.setattr(dist, "all_reduce", real)
    big = sum(n > 10_000 for n in calls)  # the gradient buckets (the norm's all-reduces are scalars)
    return (*_zero_state(engine), norms, big)


@pytest.mark.parametrize("zero", [1, 2])
def test_one_rank_zero12_skip_the_bucket_all_reduce_and_update_alike(single_process, tmp_path, monkeypatch, zero):
    """DP=1 at ZeRO-1/2: DeepSpeed's flatten / divide by 1 / all-reduce over one rank / copy-back of the
    gradient buckets is skipped; three clipped AdamW steps (the fusion unreached in the first) give the
    same model parameters, flat fp32 partitions, moments and gradient norms bit for bit as DeepSpeed's own
    reduction."""
    ours = _zero_steps(tmp_path / "a", zero, False, monkeypatch)
    theirs = _zero_steps(tmp_path / "b", zero, True, monkeypatch)
    assert ours[3] == 0 and theirs[3] >= 3  # the buckets went through the all-reduce only in DeepSpeed's
    assert all(n > 0.05 for n in ours[2]) and ours[2] == theirs[2]  # clipping active, the same norms
    _assert_same_update(ours, theirs)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero12_is_deepspeeds_own_with_the_cpu_fastpaths_off(single_process, tmp_path, monkeypatch, zero):
    """FBT_CPU_FASTPATHS=0: the engine leaves DeepSpeed's ZeRO optimiser its own methods (model/cpu_fastpaths.py)."""
    from torch._utils import _flatten_dense_tensors

    monkeypatch.setenv("FBT_CPU_FASTPATHS", "0")
    _, engine = _engine(tmp_path, parallel={"zero_stage": zero})
    assert engine.cpu_fastpaths == []
    held = vars(engine.ds.optimizer)
    assert "allreduce_and_copy" not in held and "flatten_dense_tensors_aligned" not in held
    assert held["flatten"] is _flatten_dense_tensors  # what DeepSpeed's __init__ sets


def _kept_partition_steps(tmp_path, zero: int, deepspeeds_flatten: bool):
    """Three clipped steps at DP=1 and ZeRO-``zero`` (as :func:`_zero_steps`), with the flat gradient
    partition in the kept buffer or DeepSpeed's fresh one; the model, flat partitions and moments, norms,
    and the addresses of the gradient each inner-optimiser call saw."""
    recipe, engine = _engine(tmp_path, parallel={"zero_stage": zero}, optimizer={"lr": 3e-3, "grad_clip": 0.05})
    zero_optimizer = engine.ds.optimizer
    assert "zero_kept_grad_partition" in engine.cpu_fastpaths
    if deepspeeds_flatten:
        del zero_optimizer.flatten_dense_tensors_aligned  # the class's method again
        from torch._utils import _flatten_dense_tensors

        zero_optimizer.flatten = _flatten_dense_tensors  # what DeepSpeed's __init__ sets
    addresses = []
    real_step = engine.skipper._step

    def step(*a, **k):
        addresses.append(tuple(p.grad.data_ptr() for g in engine.torch_optimizer.param_groups for p in g["params"]
                               if p.grad is not None))
        return real_step(*a, **k)

    engine.skipper._step = step
    norms = [r.grad_norm for r in _train(recipe, engine)]
    return (*_zero_state(engine), norms, addresses)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero12_flat_gradient_partition_is_kept_and_updates_alike(single_process, tmp_path, zero):
    """ZeRO-1/2 on CPU write each step's flat fp32 gradient partition into one kept buffer (the same
    memory at every step) and update exactly as with DeepSpeed's fresh concatenation: model parameters,
    flat partitions, moments and clipped gradient norms bit for bit over three steps."""
    ours = _kept_partition_steps(tmp_path / "a", zero, False)
    theirs = _kept_partition_steps(tmp_path / "b", zero, True)
    calls = len(ours[3]) // 3  # one inner-optimiser call per parameter group and step
    assert calls > 0 and len(ours[3]) == 3 * calls
    assert ours[3][:calls] == ours[3][calls:2 * calls] == ours[3][2 * calls:]  # the same memory every step
    assert all(n > 0.05 for n in ours[2]) and ours[2] == theirs[2]
    _assert_same_update(ours, theirs)


def test_flat_gradient_partition_buffer_only_for_cpu_partitions_without_offload():
    from fbt_megatron.engine import import_deepspeed
    from fbt_megatron.model import cpu_fastpaths as room

    import_deepspeed()
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from torch._utils import _flatten_dense_tensors

    def optimizer(device, offload):
        opt = object.__new__(DeepSpeedZeroOptimizer)
        opt.cpu_offload, opt.single_partition_of_fp32_groups = offload, [torch.empty(4, device=device)]
        opt.flatten = _flatten_dense_tensors
        return opt

    assert room._kept_grad_partition(optimizer("meta", False)) is None  # an accelerator's partitions
    assert room._kept_grad_partition(optimizer("cpu", True)) is None  # offload: DeepSpeed's CPU-Adam path
    assert room.install_zero(object()) == []
    opt = optimizer("cpu", False)
    for attribute, function in room._kept_grad_partition(opt).items():
        setattr(opt, attribute, function)
    # only the list that is averaged_gradients[i] goes to the kept buffer, padded with zeros as DeepSpeed pads
    grads, other = [torch.arange(3.0), torch.ones(2, 2)], [torch.arange(3.0), torch.ones(2, 2)]
    opt.averaged_gradients = {0: grads, 1: None}
    first = opt.flatten_dense_tensors_aligned(grads, 4)
    assert torch.equal(first, torch.tensor([0.0, 1, 2, 1, 1, 1, 1, 0]))
    grads[0].fill_(5.0)
    first.fill_(9.0)  # what the last step left there (the clip scales it in place): overwritten, padding too
    again = opt.flatten_dense_tensors_aligned(grads, 4)
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, torch.tensor([5.0, 5, 5, 1, 1, 1, 1, 0]))
    assert opt.flatten(grads).data_ptr() != first.data_ptr()  # another size: its own buffer
    assert opt.flatten(grads).data_ptr() == opt.flatten(grads).data_ptr()
    fresh = opt.flatten_dense_tensors_aligned(other, 4)  # e.g. the parameters at start-up: DeepSpeed's
    assert torch.equal(fresh, torch.tensor([0.0, 1, 2, 1, 1, 1, 1, 0])) and fresh.data_ptr() != first.data_ptr()
    single = [torch.arange(4.0)]  # one tensor: DeepSpeed's flatten is a view of it, no copy to save
    opt.averaged_gradients[1] = single
    assert opt.flatten(single).data_ptr() == single[0].data_ptr()
    a, b = opt.flatten(other), opt.flatten(other)  # both alive: fresh tensors, not one kept buffer
    assert a.data_ptr() != b.data_ptr() and torch.equal(a, b)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_optimizer_step_is_adamw_from_the_formula(single_process, tmp_path, zero):
    """Every call of the inner optimiser (torch's fused AdamW, on the model's parameters at ZeRO-0 and
    on DeepSpeed's flat fp32 partitions at ZeRO-1/3) moves each parameter and moment as decoupled AdamW
    does, written out here from Loshchilov & Hutter's formula in float64, over three steps (a 1-pass
    step, then 2-pass ones) with each group's own learning rate and weight decay."""
    recipe, engine = _engine(tmp_path, parallel={"zero_stage": zero},
                             optimizer={"lr": 3e-3, "weight_decay": 0.1, "betas": [0.8, 0.9]})
    opt = engine.torch_optimizer
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
    calls, checked = [], [0]
    real_step = engine.skipper._step

    def step_and_check(*a, **k):
        before = [(group, p, p.detach().double().clone(), p.grad.detach().double().clone(),
                   opt.state[p]["exp_avg"].double().clone(), opt.state[p]["exp_avg_sq"].double().clone(),
                   float(opt.state[p]["step"]))
                  for group in opt.param_groups for p in group["params"] if p.grad is not None]
        out = real_step(*a, **k)
        for group, p, p0, g, m0, v0, t0 in before:
            (b1, b2), lr, wd, eps, t = group["betas"], group["lr"], group["weight_decay"], group["eps"], t0 + 1
            m = b1 * m0 + (1 - b1) * g
            v = b2 * v0 + (1 - b2) * g * g
            ref = p0 * (1 - lr * wd) - lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
            state = opt.state[p]
            assert float(state["step"]) == t
            torch.testing.assert_close(state["exp_avg"].double(), m, rtol=1e-5, atol=1e-9)
            torch.testing.assert_close(state["exp_avg_sq"].double(), v, rtol=1e-5, atol=1e-12)
            torch.testing.assert_close(p.detach().double(), ref, rtol=1e-6, atol=1e-7)
            checked[0] += int((p.detach().double() != p0).sum())  # moved (a zero gradient without decay does not)
        calls.append(len(before))
        return out

    engine.skipper._step = step_and_check
    _train(recipe, engine)
    assert len(calls) >= 3 and all(calls)  # ZeRO-1/2 step one parameter group per call
    # ZeRO-3 leaves its parameters empty outside a forward: their full size is ds_numel
    assert checked[0] >= 2 * sum(getattr(p, "ds_numel", p.numel()) for p in engine.model.parameters())


def test_zero3_step_after_a_multi_pass_step_has_no_stale_fusion_gradient(single_process, tmp_path):
    """A 2-pass step, then 1-pass steps (the fusion unreached): ZeRO-3 gives the gradient norms and the
    later losses of ZeRO-0 (whose unreached parameters get a zero gradient). Before, ZeRO-3 stepped the fusion
    with the 2-pass step's gradient again in every later 1-pass step and counted it in the norm."""
    class TwoThenOnePass:
        def num_passes(self, step):
            return 2 if step == 1 else 1

    runs = {}
    for zero in (0, 3):
        recipe, engine = _engine(tmp_path / f"z{zero}", parallel={"zero_stage": zero}, optimizer={"lr": 3e-3})
        results = _train(recipe, engine, steps=4, schedule=TwoThenOnePass())
        runs[zero] = [(r.loss, r.grad_norm) for r in results]
    for (loss0, norm0), (loss3, norm3) in zip(runs[0], runs[3]):
        assert abs(loss3 - loss0) <= 1e-5 * max(1.0, abs(loss0)), runs
        assert abs(norm3 - norm0) <= 5e-5 * max(1.0, norm0), runs


@pytest.mark.parametrize("rank", [None, 0])
def test_one_rank_bucket_reduction_keeps_the_cast_and_the_partition_buffer(single_process, tmp_path, rank):
    """The patched ``allreduce_and_copy`` against DeepSpeed's own on the same bucket: fp32 gradients through a
    bf16 communication dtype (rounded, as the bucket rounds them) and their shares added to a given
    gradient-partition buffer; a no-op in its place fails here."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    _, engine = _engine(tmp_path, parallel={"zero_stage": 2})
    opt = engine.ds.optimizer
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(40, generator=g) / 3, torch.randn(7, 5, generator=g) / 3]
    results = []
    for reduce in (opt.allreduce_and_copy, lambda *a, **k: DeepSpeedZeroOptimizer.allreduce_and_copy(opt, *a, **k)):
        bucket = [t.clone() for t in grads]
        buffers = [torch.full((40,), 0.25), None]
        reduce(bucket, torch.bfloat16, rank=rank, output_bucket=buffers)
        results.append(bucket + buffers[:1])
    assert not torch.equal(results[0][0], grads[0])  # rounded through bf16
    for ours, theirs in zip(*results):
        assert torch.equal(ours, theirs)


class _Recorder:
    """torch.distributed as train_step sees it, recording its all-reduces."""

    def __init__(self):
        import torch.distributed

        self.real, self.all_reduces = torch.distributed, []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def all_reduce(self, tensor, *args, **kwargs):
        self.all_reduces.append(tensor.clone())
        return self.real.all_reduce(tensor, *args, **kwargs)


def test_one_rank_train_step_sums_without_all_reduce(single_process, tmp_path, monkeypatch):
    """At DP=1 the step's sums over data-parallel ranks (loss tokens, data checksum, loss) are the local
    values, taken without a gloo call; the loss is the token-weighted mean written out from the model's
    own token losses. DP=2 against DP=1 is tests/integration/test_train_pipeline.py and the torchrun tests."""
    from fbt_megatron.parallel.runner import get_runner
    from fbt_megatron.train import train_step

    recipe, engine = _engine(tmp_path)
    recorder = _Recorder()
    monkeypatch.setattr(train_step, "dist", recorder)
    from fbt_megatron.data.loaders import build_train_loader

    micro = [next(iter(build_train_loader(recipe, 0, 1, 0)))]
    with torch.no_grad():
        out = engine.model(micro[0]["input_ids"], doc_start=micro[0]["doc_start"], labels=micro[0]["labels"],
                           num_passes=1)
        mask = micro[0]["loss_mask"].float()
        expected = float((out.token_loss.float() * mask).sum() / mask.sum())
    step = train_step.FBTTrainStep(engine, get_runner(engine.model, engine), OneThenTwoPasses(), recipe.seed,
                                   torch.device("cpu"))
    result = step(1, micro, 0.0)
    assert recorder.all_reduces == []
    assert result.tokens == int(mask.sum()) and abs(result.loss - expected) <= 1e-6 * expected
