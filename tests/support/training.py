"""Helpers for the training tests: a tiny recipe (TINY, tiny_recipe: benchmarks/harness.py, which the GPU
check shares) and a picklable entry point for run_distributed."""

from __future__ import annotations

import os

from benchmarks.harness import TINY, tiny_recipe

__all__ = ["TINY", "tiny_recipe", "train_fn"]


def train_fn(recipe_data: dict, inject_nonfinite=None, env: dict | None = None, fault: str | None = None,
             probe: str | None = None, task: str | None = None) -> dict:
    """Run fbt_megatron.train.run.train in this (already distributed) process; return its summary
    (:meth:`TrainResult.summary`, with ``"probe"``: what the probe callback left).
    ``fault="<point>@<step>"`` kills the process (exit 17) at that point of a checkpoint save.
    ``inject_nonfinite``: steps whose loss is NaN, or {step: fault} (``testing.faults.FAULT_KINDS``).
    ``probe``: "final_params" (summary["probe"] = full fp32 parameters at the end), "step_states"
    (parameters, both AdamW moments and Adam's step count before training and after every step) or
    "engine_info" (DeepSpeed's optimiser and dtypes).
    ``task="sft"``: ``fbt sft``'s path (the recipe resolved against ``init_from`` and checked first)."""
    os.environ.update(env or {})
    from fbt_megatron.recipe import load_recipe
    from fbt_megatron.train.run import train
    from tests.support.faults import NonFiniteFaults

    recipe = load_recipe(data=recipe_data)
    result = train(recipe, task=task, print_fn=lambda *a, **k: None,
                   wrap_step=NonFiniteFaults(inject_nonfinite) if inject_nonfinite else None,
                   checkpoint_fault_hook=kill_at(fault) if fault else None,
                   extra_callbacks=[PROBES[probe]] if probe else ())
    return dict(result.summary(), probe=result.metrics.get("probe"))


def resolved_recipe(recipe, task: str | None = None):
    """The recipe as a one-process run resolves it (fbt_megatron.resolve: the task, init_from's sections,
    every check before launch)."""
    from fbt_megatron.resolve.resolver import resolve_run

    return resolve_run(recipe, 1, task=task).recipe


def kill_at(fault: str):
    """A checkpoint fault hook that ends the process at ``<point>@<step>`` as a crash would."""
    want_point, want_step = fault.split("@")

    def hook(point: str, step: int) -> None:
        if point == want_point and step == int(want_step):
            os._exit(17)

    return hook


def main(argv=None) -> int:
    """``python -m tests.support.training RECIPE.yaml POINT@STEP``: ``fbt train`` with a save killed
    at POINT of step STEP (the crash tests run this as a child process; not a user command)."""
    import sys

    import yaml

    from fbt_megatron import runtime
    from fbt_megatron.engine import ensure_ds_accelerator

    recipe_path, fault = (argv if argv is not None else sys.argv[1:])[:2]
    ensure_ds_accelerator()
    runtime.init_distributed()
    try:
        train_fn(yaml.safe_load(open(recipe_path)), fault=fault)
    finally:
        runtime.shutdown()
    return 0


def losses(summary: dict) -> list[float]:
    return [h[2] for h in summary["history"]]


def read_metrics(run_dir) -> list[dict]:
    """The step rows of ``<run_dir>/metrics.jsonl`` (one per trained step, in the order they were
    written; the validation lines, ``"event": "metrics"``, left out)."""
    import json
    from pathlib import Path

    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if "event" not in r]


def effective_stream(rows: list[dict]) -> dict[int, tuple[int, float]]:
    """step -> (data checksum, loss) of the run's final trajectory: a step trained again after a
    restart (it came after the last checkpoint) replaces its earlier row."""
    return {r["step"]: (r["data_checksum"], r["loss"]) for r in rows}


def load_latest_weights(run_dir: str, recipe_data: dict) -> dict:
    """In a (distributed) process: load ``<run_dir>/checkpoints/latest`` into a fresh model; return its
    step and parameter count (raises if the checkpoint is not loadable)."""
    from pathlib import Path

    from fbt_megatron.model.fbt_gpt import build_model
    from fbt_megatron.recipe import load_recipe

    recipe = load_recipe(data=recipe_data)
    model = build_model(recipe.model, recipe.feedback)
    import torch

    with torch.no_grad():  # away from any value training could have left a tensor at (a fusion weight that
        for p in model.parameters():  # got no gradient yet keeps its initial value)
            p.add_(1.0)
    before = [p.detach().clone() for p in model.parameters()]
    from fbt_megatron.checkpoint import load_model_weights, read_checkpoint_state, resolve_checkpoint

    latest = resolve_checkpoint(run_dir)
    load_model_weights(latest, model)
    state = read_checkpoint_state(latest)
    changed = sum(int(not b.equal(p.detach())) for b, p in zip(before, model.parameters()))
    return {"latest": Path(latest).name, "step": state["train_state"]["step"],
            "params_changed": changed, "params": len(before)}


def grad_norms(summary: dict) -> list[float | None]:
    return [h[5] for h in summary["history"]]


# ---------------------------------------------------------------------- state probes (collectives)
def _unshard_tp(full_over_dp, param):
    """Concatenate a TP-sharded tensor's slices over the TP group (TP-replicated: unchanged)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return full_over_dp
    parts = [torch.empty_like(full_over_dp) for _ in range(tp)]
    dist.all_gather(parts, full_over_dp.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=param.partition_dim)


def full_state(engine, moments: bool) -> dict:
    """fp32 master parameters (and AdamW moments), full over DP and TP, keyed by parameter name.
    Every rank must call it (DeepSpeed's safe_get_full_* helpers are collectives)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    def managed(p):
        return hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")

    out = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}, "adam_step": engine.optimizer_steps()}
    for name, p in engine.model.named_parameters():
        shape = getattr(p, "ds_shape", p.shape)
        value = safe_get_full_fp32_param(p) if managed(p) else p.detach()
        out["params"][name] = _unshard_tp(value.float().clone().reshape(shape), p)
        if moments:
            for key in ("exp_avg", "exp_avg_sq"):
                v = safe_get_full_optimizer_state(p, key) if managed(p) else engine.torch_optimizer.state[p][key]
                out[key][name] = _unshard_tp(v.float().clone().reshape(shape), p)
    return out


def _final_params(engine):
    from fbt_megatron.train.callbacks import Callback

    class FinalParams(Callback):
        def on_train_end(self, trainer):
            trainer.metrics["probe"] = full_state(engine, moments=False)["params"]

    return FinalParams()


def _step_states(engine):
    from fbt_megatron.train.callbacks import Callback

    class StepStates(Callback):
        """{"initial": state, step: state after that step}."""

        def on_train_start(self, trainer):
            trainer.metrics["probe"] = {"initial": full_state(engine, moments=True)}

        def on_step_end(self, trainer, result):
            trainer.metrics["probe"][result.step] = full_state(engine, moments=True)

    return StepStates()


def _engine_info(engine):
    from fbt_megatron.train.callbacks import Callback

    class EngineInfo(Callback):
        """The precision DeepSpeed actually runs with (optimiser, dtypes of weights, masters, grads)."""

        def on_train_end(self, trainer):
            ds = engine.ds
            _, accum = ds.get_data_types()
            masters = [p for g in engine.torch_optimizer.param_groups for p in g["params"]]
            masters += list(getattr(ds.optimizer, "fp32_partitioned_groups_flat", None) or [])
            trainer.metrics["probe"] = {
                "optimizer": type(ds.optimizer).__name__, "param_dtype": str(next(engine.model.parameters()).dtype),
                "master_dtype": str(masters[0].dtype), "grad_accum_dtype": str(accum),
                "communication_data_type": str(ds.communication_data_type)}

    return EngineInfo()


def _tp_all_reduces_in_backward(engine):
    """Per step, the (dtype, elements) of every all-reduce over the TP group issued inside
    ``Engine.backward`` (the model's backward and the gradient reductions after it), with the
    elements of the sequence-parallel parameters: {"calls": [[...] per step], "sp_elements": n}."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from fbt_megatron.train.callbacks import Callback

    tp_group = ps.get_tensor_model_parallel_group()
    sp_elements = sum(p.numel() for p in engine.model.parameters() if getattr(p, "sequence_parallel", False))
    calls, inside = [[]], []
    real_all_reduce, real_backward = dist.all_reduce, engine.backward

    def all_reduce(tensor, *args, group=None, **kwargs):
        if inside and group is tp_group:
            calls[-1].append((str(tensor.dtype), tensor.numel()))
        return real_all_reduce(tensor, *args, group=group, **kwargs)

    def backward(*args, **kwargs):
        inside.append(1)
        try:
            return real_backward(*args, **kwargs)
        finally:
            inside.pop()

    class TPAllReduces(Callback):
        def on_train_start(self, trainer):
            dist.all_reduce, engine.backward = all_reduce, backward

        def on_step_end(self, trainer, result):
            calls.append([])

        def on_train_end(self, trainer):
            dist.all_reduce, engine.backward = real_all_reduce, real_backward
            trainer.metrics["probe"] = {"calls": calls[:-1], "sp_elements": sp_elements}

    return TPAllReduces()


def local_training_state(engine) -> dict:
    """This rank's whole training state as DeepSpeed holds it, at any ZeRO stage and precision: the model's
    parameters (ZeRO-3: this rank's partition), the fp32 masters AdamW steps (ZeRO-1/2/3: this rank's
    partitions; bf16: the optimiser's fp32 copies) and their AdamW state (moments, step count); as bytes."""
    import torch

    def raw(t):
        return t.detach().reshape(-1).contiguous().view(torch.uint8).clone()

    opt, ds_opt = engine.torch_optimizer, engine.ds.optimizer
    masters = [p for g in opt.param_groups for p in g["params"]]
    masters += [p for p in getattr(ds_opt, "fp32_partitioned_groups_flat", None) or [] if all(p is not m for m in masters)]
    out = {f"model/{n}": raw(p.ds_tensor if hasattr(p, "ds_tensor") else p) for n, p in engine.model.named_parameters()}
    for i, p in enumerate(masters):
        out[f"master/{i}"] = raw(p)
        for key, value in opt.state.get(p, {}).items():
            out[f"master/{i}/{key}"] = raw(value)
    return out


def _unchanged_state(engine):
    from fbt_megatron.train.callbacks import Callback

    class UnchangedState(Callback):
        """Which parts of this rank's training state differ, bitwise, between the start and the end."""

        def on_train_start(self, trainer):
            self.before = local_training_state(engine)

        def on_train_end(self, trainer):
            after = local_training_state(engine)
            trainer.metrics["probe"] = {
                "compared": sorted(self.before), "changed": sorted(k for k in self.before if not after[k].equal(self.before[k])),
                "optimizer": type(engine.ds.optimizer).__name__, "param_dtype": str(next(engine.model.parameters()).dtype)}

    return UnchangedState()


def _reduced_grads(engine):
    """Per step: the fp32 gradient accumulators after the boundary backward's data-parallel reduction; with the
    overlapped reduction, the buckets whose all-reduce had started before that backward returned (of how
    many); with DeepSpeed's own, the accumulators just before it. At the end, the fp32 masters."""
    from fbt_megatron.train.callbacks import Callback

    record = {"steps": [], "overlapped": engine.overlapped_reduce is not None}
    flats = engine.ds.optimizer.fp32_groups_gradients_flat
    real_backward, real_allreduce = engine.ds.backward, engine.ds.allreduce_gradients

    def backward(*a, **k):
        out = real_backward(*a, **k)
        if engine.overlapped_reduce is not None and engine.overlapped_reduce.armed:
            record["steps"].append({"started_in_backward": engine.overlapped_reduce.in_flight(),
                                    "buckets": len(engine.overlapped_reduce.buckets)})
        return out

    def allreduce_gradients(*a, **k):  # called after every backward; it reduces at the boundary only
        if engine.ds.is_gradient_accumulation_boundary():
            record["steps"].append({"before": [f.clone() for f in flats]})
        return real_allreduce(*a, **k)

    engine.ds.backward, engine.ds.allreduce_gradients = backward, allreduce_gradients
    real_finish = engine.backward

    def engine_backward(loss, is_boundary):
        real_finish(loss, is_boundary)
        if is_boundary:
            record["steps"][-1]["reduced"] = [f.clone() for f in flats]

    engine.backward = engine_backward

    class ReducedGrads(Callback):
        def on_train_end(self, trainer):
            record["params"] = full_state(engine, moments=False)["params"]
            trainer.metrics["probe"] = record

    return ReducedGrads()


PROBES = {"final_params": _final_params, "reduced_grads": _reduced_grads, "step_states": _step_states, "engine_info": _engine_info,
          "unchanged_state": _unchanged_state,
          "tp_all_reduces_in_backward": _tp_all_reduces_in_backward}


if __name__ == "__main__":
    raise SystemExit(main())
