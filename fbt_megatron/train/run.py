"""Assemble a run from its resolved plan and train it (inside an initialised process group).

``fbt train`` (``launch/train_cli.py``) resolves the recipe (``fbt_megatron.resolve``), starts torch.distributed
and calls :func:`train`, which resolves it again under the run directory's lock and builds from that plan;
tests call :func:`train` directly on gloo processes.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from fbt_megatron import runtime
from fbt_megatron.files import write_text_atomic
from fbt_megatron.logs import printer
from fbt_megatron.recipe import Recipe
from fbt_megatron.resolve.plan import RunPlan

if TYPE_CHECKING:  # (imported inside build(): DeepSpeed's accelerator is chosen first)
    from fbt_megatron.checkpoint import CheckpointManager
    from fbt_megatron.train.callbacks.validation import Validation
    from fbt_megatron.train.trainer import Trainer

log_info = printer(logging.getLogger(__name__))


@dataclass
class TrainResult:
    """What :func:`train` did in this invocation (``summary()``: the dict ``summary.json`` holds)."""
    name: str
    run_dir: str
    step: int  # the run's step at the end (including earlier invocations)
    total_steps: int
    skipped_steps: int
    pass_counts: dict
    stop_reason: str | None
    preempted: bool | None
    checkpoint: str | None
    feedback_depth: int
    val_loss_1pass: float | None
    val_loss_deep: float | None  # at feedback_depth passes
    tokens_per_s: float | None
    num_params: int
    history: list = field(default_factory=list)  # StepResults of this invocation
    val_history: list = field(default_factory=list)  # this invocation's validations
    metrics: dict = field(default_factory=dict)  # everything the callbacks left in trainer.metrics

    def summary(self) -> dict:
        return {
            "name": self.name, "run_dir": self.run_dir, "step": self.step, "total_steps": self.total_steps,
            "skipped_steps": self.skipped_steps, "pass_counts": dict(self.pass_counts),
            "stop_reason": self.stop_reason, "preempted": self.preempted, "checkpoint": self.checkpoint,
            "val_loss_1pass": self.val_loss_1pass, f"val_loss_{self.feedback_depth}pass": self.val_loss_deep,
            "feedback_depth": self.feedback_depth, "tokens_per_s": self.tokens_per_s,
            "history": [(r.step, r.num_passes, r.loss, r.skipped, r.data_checksum, r.grad_norm) for r in self.history],
            "step_seconds": [r.seconds for r in self.history], "num_params": self.num_params,
            "val_history": self.val_history,
        }


@dataclass
class Run:
    """A run assembled by :func:`build`, ready for :func:`fit`."""
    plan: RunPlan
    recipe: Recipe
    run_dir: Path
    log: Callable[..., None]  # print-shaped; silent on ranks other than 0
    trainer: Trainer
    checkpoints: CheckpointManager
    latest: Path | None  # the checkpoint resumed from
    validation: Validation
    feedback_depth: int
    num_params: int
    layout: dict
    dp_size: int


# ---------------------------------------------------------------------- the run
def train(recipe: Recipe, *, task: str | None = None, print_fn=log_info, checkpoint_fault_hook=None, wrap_step=None,
          extra_callbacks=()) -> TrainResult:
    """Train ``recipe`` in this process group, holding its run directory's lock (rank 0 takes it before
    anything in the run directory is read or written; a second live run on it raises
    :class:`~fbt_megatron.train.run_lock.RunDirLocked` on every rank): resolve the plan
    (:func:`~fbt_megatron.resolve.resolver.resolve_run`, ``task`` as there), :func:`build`, :func:`fit`,
    :func:`summarise`.

    Hooks (tests, tools): ``checkpoint_fault_hook(point, step)`` is called at the points of a checkpoint
    save (see :class:`CheckpointManager`); ``wrap_step(step_fn) -> step_fn`` wraps the train step;
    ``extra_callbacks``: callables ``(engine) -> Callback`` (a callback may leave results in
    ``trainer.metrics``, returned in ``TrainResult.metrics``)."""
    import os

    from fbt_megatron.train import callbacks as cb
    from fbt_megatron.train.run_lock import RunDirLocked, RunLock

    # Catch the preemption signals from the very start: one that arrives while the model is built
    # stays pending and stops the run after its first step (the SLURM batch script's trap also writes
    # $FBT_PREEMPT_FILE, which rank 0 reads at every step end; see callbacks.Preemption).
    preemption = cb.Preemption(runtime.device(), print_fn=print_fn if dist.get_rank() == 0 else (lambda *a, **k: None),
                               stop_file=os.environ.get("FBT_PREEMPT_FILE") or None)
    preemption.arm()
    lock = RunLock(recipe.resolved_run_dir())
    refused = None
    if dist.get_rank() == 0:
        try:
            lock.acquire()
        except RunDirLocked as e:
            refused = str(e)
        except Exception as e:  # e.g. the run directory cannot be written: every rank reports it, now
            refused = f"cannot take the run-directory lock {lock.path}: {type(e).__name__}: {e}"
    box = [refused]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0, device=runtime.device())
    try:
        if box[0] is not None:
            raise RunDirLocked(box[0])
        from fbt_megatron.resolve.resolver import resolve_run

        plan = resolve_run(recipe, dist.get_world_size(), task=task)
        run = build(plan, preemption, print_fn=print_fn, checkpoint_fault_hook=checkpoint_fault_hook,
                    wrap_step=wrap_step, extra_callbacks=extra_callbacks)
        fit(run)
        return summarise(run)
    finally:
        preemption.close()  # (idempotent) also when the run failed before its trainer existed
        lock.release()


def build(plan: RunPlan, preemption, *, print_fn=log_info, checkpoint_fault_hook=None, wrap_step=None,
          extra_callbacks=()) -> Run:
    """Everything a run needs, constructed from its plan in this process group: the parallel state, data,
    the model (resumed from the plan's checkpoint), the DeepSpeed engine, the train step and the callbacks."""
    import torch
    from megatron.core import parallel_state as ps

    from fbt_megatron.checkpoint import CheckpointManager
    from fbt_megatron.checkpoint.shards import StateFragments, param_specs
    from fbt_megatron.checkpoint.state import CheckpointState
    from fbt_megatron.data.loaders import TrainBatches, build_valid_batches, prepare_data
    from fbt_megatron.engine import Engine
    from fbt_megatron.model.fbt_gpt import build_model
    from fbt_megatron.parallel.runner import get_runner
    from fbt_megatron.passes import PassSchedule
    from fbt_megatron.train import callbacks as cb
    from fbt_megatron.train import sft
    from fbt_megatron.train.lr_schedule import LRSchedule
    from fbt_megatron.train.train_step import FBTTrainStep, evaluate
    from fbt_megatron.train.trainer import Trainer, TrainState

    recipe, world, dp_size = plan.recipe, plan.layout.world_size, plan.layout.data
    runtime.init_parallel_state(runtime.ParallelLayout(tensor=recipe.parallel.tensor,
                                                       pipeline=recipe.parallel.pipeline), seed=recipe.seed,
                                timeout_s=recipe.train.collective_timeout_s)
    dp_rank = ps.get_data_parallel_rank()
    device = runtime.device()
    run_dir = recipe.resolved_run_dir()
    log = print_fn if dist.get_rank() == 0 else (lambda *a, **k: None)

    data = prepare_data(plan.data, log)
    for warning in plan.warnings:
        log(warning)
    ckpt = CheckpointManager(run_dir / "checkpoints", keep_last=recipe.checkpoint.keep_last,
                             async_save=recipe.checkpoint.async_save, fault_hook=checkpoint_fault_hook,
                             verify_on_load=recipe.checkpoint.verify_on_load)
    latest = plan.resume.checkpoint  # the model is built with the rule it was trained under (plan.recipe)
    # the plan read the fingerprints to check the resume; the embedded mix may be built since: read again
    known = plan.data.fingerprints if plan.data.build_embedded is None else None
    data_record, data_changed = _data_record(recipe, data, latest, run_dir, log, known)
    dtype = torch.bfloat16 if plan.precision == "bf16" else torch.float32
    model = build_model(recipe.model, recipe.feedback, sequence_parallel=recipe.parallel.sequence_parallel,
                        dtype=dtype)
    sft.init_weights(plan.resume.init_from, model, log=log,  # init_from: weights only, when not resuming
                     verify=recipe.checkpoint.verify_on_load)
    specs = param_specs(model)  # before DeepSpeed wraps (ZeRO-3 empties the parameters)
    engine = Engine(model, recipe)
    zero = StateFragments(engine, specs)
    layout = {"tensor": recipe.parallel.tensor, "pipeline": recipe.parallel.pipeline, "data": dp_size,
              "zero_stage": recipe.parallel.zero_stage, "dtype": plan.precision}
    state, schedule = TrainState(), PassSchedule.of(recipe.schedule, recipe.feedback)
    loader = TrainBatches(recipe, dp_rank, dp_size, data_config=data)
    trained = recipe if plan.data.build_embedded is None else recipe.model_copy(  # state.json names the mix
        update={"data": recipe.data.model_copy(update={"pipeline": plan.data.config})})
    checkpoint_state = CheckpointState(train_state=state, pass_schedule=schedule, loader=loader, recipe=trained,
                                   layout=layout)
    if latest is not None:
        saved = ckpt.load_training_state(latest, zero)
        checkpoint_state.load_state_dict(saved)
        if data_changed:  # the saved loader position names documents of the old data: continue by the cursor
            loader.load_state_dict(None)
        log(f"resumed from {latest} at step {state.step} (saved with {saved['layout']}, now "
            f"tp={recipe.parallel.tensor} pp={recipe.parallel.pipeline} dp={dp_size} "
            f"zero={recipe.parallel.zero_stage})")

    loader.start(state.consumed_sequences)
    valid = build_valid_batches(recipe, dp_rank, dp_size, data_config=data)
    runner = get_runner(engine.model, engine)  # whole model (PP=1) or pipeline stages
    step_fn = FBTTrainStep(engine, runner, schedule, recipe.seed, device, attention_mask=recipe.model.attention_mask)
    if wrap_step is not None:
        step_fn = wrap_step(step_fn)
    lr_fn = LRSchedule(recipe.lr_schedule, recipe.optimizer.lr, recipe.train.steps)
    feedback_depth = plan.feedback_depth

    n_params = _count_params(model) * recipe.parallel.tensor  # approx (TP shards)

    # The run's tokenizer (tokenizer.model, or tokenizer.json with its config files) and chat template
    # travel with every checkpoint (as with an HF export): `fbt generate`/`fbt eval` work from anywhere.
    tokenizer_file = sft.checkpoint_files(plan.data, run_dir, dist.get_rank())

    def save(st: TrainState):  # st is the trainer's state, which checkpoint_state holds
        return ckpt.save(st.step, zero, dict(checkpoint_state.state_dict(), data=data_record), files=tokenizer_file)

    validation = cb.Validation(recipe.eval.every, lambda k: evaluate(runner, valid, k, device).loss,
                               list(plan.eval_passes),
                               at_end=recipe.eval.at_end)
    checkpointer = cb.Checkpointer(save, recipe.checkpoint.every, at_end=recipe.checkpoint.at_end, print_fn=log,
                                   async_save=recipe.checkpoint.async_save, poll_fn=ckpt.poll)
    callbacks = [validation, *_loggers(recipe, run_dir, _flops_fn(recipe, n_params), world, log),
                 preemption, checkpointer]
    if recipe.profile.enabled:
        callbacks.append(cb.Profiler(run_dir / "profile", recipe.profile.start_step, recipe.profile.num_steps))
    callbacks += [make(engine) for make in extra_callbacks]

    checkpoint_state.add_callbacks(callbacks)
    trainer = Trainer(step_fn=step_fn, batches=iter(loader), micro_batches_per_step=plan.micro_batches_per_step,
                      lr_fn=lr_fn, total_steps=plan.total_steps, global_batch_size=recipe.global_batch_size,
                      state=state, callbacks=callbacks, max_nonfinite_in_row=recipe.train.max_nonfinite_in_row, log=log)
    return Run(plan=plan, recipe=recipe, run_dir=run_dir, log=log, trainer=trainer, checkpoints=ckpt, latest=latest,
               validation=validation, feedback_depth=feedback_depth, num_params=n_params, layout=layout,
               dp_size=dp_size)


def _data_record(recipe: Recipe, data_config, latest: Path | None, run_dir: Path, log,
                 known: dict | None = None) -> tuple[dict, bool]:
    """The datasets' fingerprints the run's checkpoints record (``state.json``'s ``data``), checked against
    the resumed checkpoint's: a change is refused in one sentence, or with ``checkpoint.allow_data_change``
    logged and written to ``metrics.jsonl`` (rank 0) and kept in ``data.changes``. ``known``: the
    fingerprints the run plan read already. Returns (record, changed)."""
    import time

    from fbt_megatron.checkpoint import read_checkpoint_state
    from fbt_megatron.data.fingerprint import check_resume_data, data_fingerprints, trained_on_synthetic

    now = known if known is not None else data_fingerprints(data_config)
    state = read_checkpoint_state(latest) if latest is not None else {}
    saved = state.get("data") or {}
    changes = check_resume_data(str(latest), saved.get("fingerprints"), now, recipe.checkpoint.allow_data_change,
                                from_synthetic=trained_on_synthetic(state)) if latest is not None else []
    history = list(saved.get("changes", []))
    if changes:
        step = state["train_state"]["step"]
        row = {"event": "data_changed", "step": step, "time": time.time(), "changes": changes}
        history.append({k: row[k] for k in ("step", "changes")})
        log(f"data changed since {latest} (checkpoint.allow_data_change=true): {'; '.join(changes)}")
        if dist.get_rank() == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
    return {"fingerprints": now, "changes": history}, bool(changes)


def _flops_fn(recipe: Recipe, n_params: int):
    """A step's training FLOPs (the console's MFU) from its StepResult: the matmuls per token as ``fbt plan``
    counts them, attention per (query, key) pair the step attended (``StepResult.attention_pairs``)."""
    from fbt_megatron.train.callbacks import attention_flops_per_pair, model_flops_per_token

    m = recipe.model
    # matmul parameters as fbt plan counts them: not the embedding lookups (the word embedding when the
    # LM head has its own weight, learned positions)
    lookups = (0 if m.tie_embeddings else m.padded_vocab_size(recipe.parallel.tensor) * m.hidden_size) + \
        (m.max_sequence_length * m.hidden_size if m.position_embedding_type == "learned_absolute" else 0)
    fusion = 0 if recipe.feedback.fusion == "off" else 2 * m.hidden_size * m.hidden_size  # W_U, W_G
    def step_flops(r) -> float:
        per_token = model_flops_per_token(n_params - lookups - fusion, m.num_layers, m.hidden_size, 0, r.num_passes,
                                          recipe.feedback.grad_mode, fusion_params=fusion,
                                          fused_first_pass=recipe.feedback.fused_first_pass)
        pairs = attention_flops_per_pair(m.num_layers, m.hidden_size, r.num_passes, recipe.feedback.grad_mode)
        return per_token * r.tokens + pairs * r.attention_pairs

    return step_flops


def _loggers(recipe: Recipe, run_dir: Path, flops_fn, world: int, log) -> list:
    from fbt_megatron.train import callbacks as cb

    loggers = [cb.ConsoleLogger(recipe.logging.log_every, flops_fn, recipe.logging.peak_flops, world, print_fn=log),
               cb.MetricsFile(run_dir / "metrics.jsonl")]
    if recipe.logging.tensorboard:
        loggers.append(cb.TensorBoardLogger(run_dir / "tensorboard"))
    if recipe.logging.wandb:
        loggers.append(cb.WandbLogger(recipe.logging.wandb_project, recipe.name, recipe.model_dump(mode="json")))
    return loggers


def fit(run: Run) -> None:
    """Train to the recipe's step (or report on a run that is already there); wait for the last save,
    then close the callbacks (the preemption handler releases its signals only then: a SIGTERM must
    not cut the last save short)."""
    recipe, trainer, log, state = run.recipe, run.trainer, run.log, run.trainer.state
    try:
        if state.step < trainer.total_steps:
            log(f"training {recipe.name}: steps {state.step}->{trainer.total_steps} of {recipe.train.steps}, "
                f"layout {run.layout}, global batch {recipe.global_batch_size} seq x {recipe.data.seq_length} tok, "
                f"accumulation {run.plan.micro_batches_per_step}, "
                + (f"feedback from step {recipe.schedule.feedback_start_step} (mix {recipe.schedule.mix})"
                   if recipe.feedback.fusion != "off" else "one pass every step (feedback.fusion: off)")
                + ("" if runtime.use_cuda() else f", CPU threads {torch.get_num_threads()}"))
            trainer.fit()
        else:  # e.g. `make train` again after a finished run (the plan's warning said so): report on the checkpoint
            trainer.metrics["checkpoint"] = str(run.latest) if run.latest is not None else None
            if recipe.eval.at_end:
                run.validation.run(trainer)
        run.checkpoints.wait()
    finally:
        trainer.close()


def summarise(run: Run) -> TrainResult:
    """The run's :class:`TrainResult`; rank 0 writes ``<run_dir>/summary.json`` if it trained, or if the
    summary there is not current (:func:`summary_is_current`: a run killed between its last save and its
    summary, launched again, finds its checkpoint at the last step and the summary older or missing)."""
    trainer, state, depth = run.trainer, run.trainer.state, run.feedback_depth
    val = trainer.metrics.get("val_loss", {})
    result = TrainResult(
        name=run.recipe.name, run_dir=str(run.run_dir), step=state.step, total_steps=run.recipe.train.steps,
        skipped_steps=state.skipped_steps, pass_counts=dict(state.pass_counts), stop_reason=trainer.stop_reason,
        preempted=trainer.metrics.get("preempted"), checkpoint=trainer.metrics.get("checkpoint"),
        feedback_depth=depth, val_loss_1pass=val.get(1), val_loss_deep=val.get(depth),
        tokens_per_s=trainer.metrics.get("tokens_per_s"), num_params=run.num_params, history=list(trainer.history),
        val_history=trainer.metrics.get("val_history", []), metrics=trainer.metrics)
    if dist.get_rank() == 0 and (trainer.history
                                 or not summary_is_current(run.run_dir, state.step, run.recipe.train.steps)):
        # (history/step_seconds stay out of summary.json)
        run.run_dir.mkdir(parents=True, exist_ok=True)
        summary = {k: v for k, v in result.summary().items() if k not in ("history", "step_seconds")}
        write_text_atomic(run.run_dir / "summary.json", json.dumps(summary, indent=1, default=str))
    return result


def summary_is_current(run_dir: Path, step: int, total_steps: int) -> bool:
    """Whether ``run_dir/summary.json`` is readable, at ``step`` or later, and of ``total_steps`` steps."""
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and summary.get("step", -1) >= step and summary.get("total_steps") == total_steps


def _count_params(model) -> int:
    """Parameters of the whole model on this TP rank (summed over pipeline stages, the tied
    last-stage embedding copy not counted twice)."""
    import torch
    from megatron.core import parallel_state as ps

    n = sum(p.numel() for p in model.parameters()
            if not (getattr(p, "shared_embedding", False) and not ps.is_pipeline_first_stage(ignore_virtual=True)))
    total = torch.tensor(n, dtype=torch.int64, device=runtime.device())
    dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    return int(total)


def format_summary(result: TrainResult) -> str:
    s = result.summary()
    d = s["feedback_depth"]
    f = lambda x: "n/a" if x is None or not math.isfinite(x) else f"{x:.4f}"  # noqa: E731
    lines = [
        f"== summary: {s['name']} ==",
        f"steps             {s['step']}/{s['total_steps']} (skipped {s['skipped_steps']})",
        f"pass mix          {s['pass_counts']}",
        f"val loss 1 pass   {f(s['val_loss_1pass'])}",
        f"val loss {d} passes {f(s.get(f'val_loss_{d}pass'))}",
        f"checkpoint        {s['checkpoint']}",
        f"run dir           {s['run_dir']}",
    ]
    if s.get("stop_reason"):
        lines.append(s["stop_reason"])
    return "\n".join(lines)


