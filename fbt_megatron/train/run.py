"""Assemble a run from a validated recipe and train it (inside an initialised process group).

``fbt train`` (``cli.py``) validates the recipe, starts torch.distributed and calls :func:`train`;
tests call :func:`train` directly on gloo processes.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch.distributed as dist

from fbt_megatron import runtime
from fbt_megatron.logs import printer
from fbt_megatron.recipe import Recipe, adopt_checkpoint_rule, bf16_accumulation_warning, check_layout

log_info = printer(logging.getLogger(__name__))
VALID_OFFSET = 1 << 40  # the synthetic validation stream lives far from the training stream


# ---------------------------------------------------------------------- data
def build_train_loader(recipe: Recipe, dp_rank: int, dp_size: int, consumed_sequences: int,
                       saved_cursor: dict | None = None):
    """This rank's training batches from the global cursor. ``saved_cursor`` is the loader state a
    checkpoint recorded: the pipeline resumes from it and refuses a changed seed, mix, tokenizer or
    split (a silently different data stream would make the resumed run a different experiment)."""
    d = recipe.data
    kw = dict(micro_batch_size=recipe.batch.micro_batch_size, global_batch_size=recipe.global_batch_size,
              dp_rank=dp_rank, dp_size=dp_size, consumed_sequences=consumed_sequences)
    if d.source == "synthetic":
        from fbt_megatron.data.synthetic import SyntheticLoader

        return SyntheticLoader(_synthetic_cfg(recipe), **kw)
    return _pipeline_loader(recipe, split="train", state=saved_cursor, **kw)


def build_valid_batches(recipe: Recipe, dp_rank: int, dp_size: int) -> list[dict]:
    """This rank's share of a fixed validation set (same set for every DP size)."""
    d, mbs = recipe.data, recipe.batch.micro_batch_size
    n = max(dp_size, d.valid_sequences - d.valid_sequences % dp_size)
    if n % (mbs * dp_size):
        mbs = 1
    kw = dict(micro_batch_size=mbs, global_batch_size=n, dp_rank=dp_rank, dp_size=dp_size,
              consumed_sequences=0)
    if d.source == "synthetic":
        from fbt_megatron.data.synthetic import SyntheticLoader

        loader = SyntheticLoader(_synthetic_cfg(recipe), offset=VALID_OFFSET, **kw)
    else:
        loader = _pipeline_loader(recipe, split="valid", **kw)
    it = iter(loader)
    return [next(it) for _ in range(n // (mbs * dp_size))]


def _synthetic_cfg(recipe: Recipe):
    return recipe.data.synthetic.model_copy(update={"seq_length": recipe.data.seq_length})


def prepare_data(recipe: Recipe, log=log_info) -> None:
    """Build the embedded token mix if the recipe uses it and it is missing (offline, idempotent):
    rank 0 builds, the others wait; then every rank reads the mix's ``data`` section."""
    d = recipe.data
    if d.source != "pipeline" or d.pipeline is not None:
        return
    from data_pipeline.embedded import build_embedded

    kw = dict(seq_length=d.seq_length, progress=False, log=lambda m: log(f"[data] {m}"))
    if dist.get_rank() == 0:
        section = build_embedded(d.embedded_dir, **kw)
    dist.barrier()
    if dist.get_rank() != 0:
        section = build_embedded(d.embedded_dir, **dict(kw, log=lambda m: None))
    d.pipeline = dict(section, seq_length=d.seq_length)


def _pipeline_config(recipe: Recipe):
    from data_pipeline.config import DataConfig

    cfg = dict(recipe.data.pipeline or {})
    cfg["seq_length"] = recipe.data.seq_length
    return DataConfig.model_validate(cfg)


def check_tokenizer(recipe: Recipe) -> None:
    if recipe.data.source != "pipeline":
        return
    from data_pipeline.tokenizer import load_tokenizer

    vocab = load_tokenizer(_pipeline_config(recipe).tokenizer).get_piece_size()
    if vocab > recipe.model.vocab_size:
        raise ValueError(f"model.vocab_size={recipe.model.vocab_size} is smaller than the tokenizer's "
                         f"vocabulary ({vocab})")


def _pipeline_loader(recipe: Recipe, split: str, **kw):
    from data_pipeline.loader import build_loader

    # split="valid" reads only the held-out documents (data.pipeline.valid_documents per source), which
    # the train split never contains.
    return build_loader(_pipeline_config(recipe), split=split, **kw)


# ---------------------------------------------------------------------- the run
def train(recipe: Recipe, *, print_fn=log_info, checkpoint_fault_hook=None, wrap_step=None,
          extra_callbacks=()) -> dict:
    """Train ``recipe`` in this process group, holding its run directory's lock (rank 0 takes it before
    anything in the run directory is read or written; a second live run on it raises
    :class:`~fbt_megatron.train.run_lock.RunDirLocked` on every rank). See :func:`_train` for the rest."""
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
        return _train(recipe, preemption, print_fn=print_fn, checkpoint_fault_hook=checkpoint_fault_hook,
                      wrap_step=wrap_step, extra_callbacks=extra_callbacks)
    finally:
        preemption.release()
        lock.release()


def _train(recipe: Recipe, preemption, *, print_fn=log_info, checkpoint_fault_hook=None, wrap_step=None,
           extra_callbacks=()) -> dict:
    """Train ``recipe`` in this process group. Hooks (tests, tools; the run reads none itself):
    ``checkpoint_fault_hook(point, step)`` is called at the points of a checkpoint save (see
    :class:`CheckpointManager`); ``wrap_step(step_fn) -> step_fn`` wraps the train step (e.g.
    ``fbt_megatron.testing.faults.NonFiniteFaults``); ``extra_callbacks``: callables ``(engine) -> Callback``
    (a callback may leave a result in ``trainer.metrics["probe"]``, returned as ``summary["probe"]``)."""
    import torch
    from megatron.core import parallel_state as ps

    from fbt_megatron.model.fbt_gpt import build_model
    from fbt_megatron.passes import PassSchedule
    from fbt_megatron.train import callbacks as cb
    from fbt_megatron.checkpoint import CheckpointError, CheckpointManager, read_checkpoint_state
    from fbt_megatron.checkpoint.shards import StateFragments, param_specs
    from fbt_megatron.engine import Engine
    from fbt_megatron.train.lr_schedule import LRSchedule
    from fbt_megatron.parallel.runner import get_runner
    from fbt_megatron.train.train_step import FBTTrainStep, evaluate
    from fbt_megatron.train.trainer import Trainer, TrainState

    world = dist.get_world_size()
    dp_size = check_layout(recipe, world)
    runtime.init_parallel_state(runtime.ParallelLayout(tensor=recipe.parallel.tensor,
                                                       pipeline=recipe.parallel.pipeline), seed=recipe.seed,
                                timeout_s=recipe.train.collective_timeout_s)
    dp_rank = ps.get_data_parallel_rank()
    device = runtime.device()
    run_dir = recipe.resolved_run_dir()
    log = print_fn if dist.get_rank() == 0 else (lambda *a, **k: None)

    prepare_data(recipe, log)
    check_tokenizer(recipe)
    if bf16_accumulation_warning(recipe):
        log(bf16_accumulation_warning(recipe))
    ckpt = CheckpointManager(run_dir / "checkpoints", keep_last=recipe.checkpoint.keep_last,
                             async_save=recipe.checkpoint.async_save, fault_hook=checkpoint_fault_hook)
    if not recipe.checkpoint.resume and ckpt.has_checkpoints():
        # Never mix a new run's checkpoints with an older run's (pruning and `latest` would interleave).
        raise CheckpointError(f"checkpoint.resume=false, but {ckpt.root} already holds checkpoints; "
                              f"choose another run_dir or remove {ckpt.root}")
    latest = ckpt.latest() if recipe.checkpoint.resume else None
    if latest is not None:  # the model is built with the rule the checkpoint was trained under
        adopted = adopt_checkpoint_rule(recipe, read_checkpoint_state(latest).get("recipe", {}), latest)
        if adopted:
            log(adopted)
    dtype = torch.bfloat16 if recipe.resolved_precision() == "bf16" else torch.float32
    model = build_model(recipe.model, recipe.feedback, sequence_parallel=recipe.parallel.sequence_parallel,
                        dtype=dtype)
    specs = param_specs(model)  # before DeepSpeed wraps (ZeRO-3 empties the parameters)
    engine = Engine(model, recipe)
    zero = StateFragments(engine, specs)
    state, saved_cursor = TrainState(), None
    if latest is not None:
        saved = ckpt.load_training_state(latest, zero)
        state = TrainState.from_json(saved["train_state"])
        saved_cursor = saved.get("data_cursor", {}).get("loader")
        log(f"resumed from {latest} at step {state.step} (saved with {saved['layout']}, now "
            f"tp={recipe.parallel.tensor} pp={recipe.parallel.pipeline} dp={dp_size} "
            f"zero={recipe.parallel.zero_stage})")

    schedule = PassSchedule(recipe.schedule)
    loader = build_train_loader(recipe, dp_rank, dp_size, state.consumed_sequences, saved_cursor)
    valid = build_valid_batches(recipe, dp_rank, dp_size)
    runner = get_runner(engine.model, engine)  # whole model (PP=1) or pipeline stages
    step_fn = FBTTrainStep(engine, schedule, recipe.seed, device, runner=runner)
    if wrap_step is not None:
        step_fn = wrap_step(step_fn)
    lr_fn = LRSchedule(recipe.lr_schedule, recipe.optimizer.lr, recipe.train.steps)
    feedback_depth = recipe.eval.feedback_passes or (schedule.max_passes if recipe.feedback.fusion != "off" else 1)

    n_params = _count_params(model) * recipe.parallel.tensor  # approx (TP shards)
    m = recipe.model
    # matmul parameters as fbt plan counts them: not the embedding lookups (the word embedding when the
    # LM head has its own weight, learned positions)
    lookups = (0 if m.tie_embeddings else m.padded_vocab_size(recipe.parallel.tensor) * m.hidden_size) + \
        (m.max_sequence_length * m.hidden_size if m.position_embedding_type == "learned_absolute" else 0)
    fusion = 0 if recipe.feedback.fusion == "off" else 2 * m.hidden_size * m.hidden_size  # W_U, W_G
    flops_fn = lambda k: cb.model_flops_per_token(  # noqa: E731
        n_params - lookups - fusion, m.num_layers, m.hidden_size, recipe.data.seq_length, k,
        recipe.feedback.grad_mode, fusion_params=fusion,
        fused_first_pass=recipe.feedback.fused_first_pass)
    layout = {"tensor": recipe.parallel.tensor, "pipeline": recipe.parallel.pipeline, "data": dp_size,
              "zero_stage": recipe.parallel.zero_stage, "dtype": runtime.default_dtype_name()}

    # The run's tokenizer travels with every checkpoint (as with an HF export): `fbt generate`/`fbt eval`
    # work from anywhere, also when the recipe named it by a path relative to where training ran.
    tokenizer_file = ({"tokenizer.model": Path(_pipeline_config(recipe).tokenizer)}
                      if recipe.data.source == "pipeline" else None)

    def save(st: TrainState):
        payload = {"train_state": st.to_json(), "optimizer_steps": st.optimizer_steps, "layout": layout,
                   "pass_schedule": {"position": st.step, **recipe.schedule.model_dump()},
                   "data_cursor": {"consumed_sequences": st.consumed_sequences, "loader": loader.state_dict()},
                   "recipe": recipe.model_dump(mode="json")}
        return ckpt.save(st.step, zero, payload, files=tokenizer_file)

    validation = cb.Validation(recipe.eval.every, lambda k: evaluate(runner, valid, k, device).loss,
                               [1, feedback_depth], at_end=recipe.eval.at_end, print_fn=log)
    callbacks = [
        validation,
        cb.ConsoleLogger(recipe.logging.log_every, flops_fn, recipe.logging.peak_flops, world, print_fn=log),
    ]
    if recipe.logging.tensorboard:
        callbacks.append(cb.TensorBoardLogger(run_dir / "tensorboard"))
    if recipe.logging.wandb:
        callbacks.append(cb.WandbLogger(recipe.logging.wandb_project, recipe.name, recipe.model_dump(mode="json")))
    # Before the Checkpointer: a signal seen at this step's end makes the Checkpointer save it.
    callbacks.append(preemption)
    callbacks.append(cb.MetricsFile(run_dir / "metrics.jsonl"))
    callbacks.append(cb.Checkpointer(save, recipe.checkpoint.every, at_end=recipe.checkpoint.at_end, print_fn=log,
                                   async_save=recipe.checkpoint.async_save, poll_fn=ckpt.poll))
    if recipe.profile.enabled:
        callbacks.append(cb.Profiler(run_dir / "profile", recipe.profile.start_step, recipe.profile.num_steps))
    callbacks += [make(engine) for make in extra_callbacks]

    total = min(recipe.train.steps, recipe.train.stop_at_step or recipe.train.steps)
    trainer = Trainer(step_fn=step_fn, batches=iter(loader), micro_batches_per_step=recipe.accumulation_steps(dp_size),
                      lr_fn=lr_fn, total_steps=total, global_batch_size=recipe.global_batch_size, state=state,
                      callbacks=callbacks, max_nonfinite_in_row=recipe.train.max_nonfinite_in_row, log=log)
    try:
        if state.step < total:
            log(f"training {recipe.name}: steps {state.step}->{total} of {recipe.train.steps}, layout {layout}, "
                f"global batch {recipe.global_batch_size} seq x {recipe.data.seq_length} tok, "
                f"accumulation {recipe.accumulation_steps(dp_size)}, feedback from step "
                f"{recipe.schedule.feedback_start_step} (mix {recipe.schedule.mix})")
            trainer.fit()
        else:  # e.g. `make train` again after a finished run: report on the checkpoint instead
            log(f"{recipe.name} is already at step {state.step} of {total}: nothing to train "
                f"(raise train.steps to continue, or use a new run_dir)")
            trainer.metrics["checkpoint"] = str(latest) if latest is not None else None
            if recipe.eval.at_end:
                validation.run(trainer)
        ckpt.wait()
    finally:
        preemption.release()  # after the last save: a SIGTERM must not cut it short

    val = trainer.metrics.get("val_loss", {})
    summary = {
        "name": recipe.name, "run_dir": str(run_dir), "step": state.step, "total_steps": recipe.train.steps,
        "skipped_steps": state.skipped_steps, "pass_counts": dict(state.pass_counts),
        "stop_reason": trainer.stop_reason, "preempted": trainer.metrics.get("preempted"),
        "checkpoint": trainer.metrics.get("checkpoint"),
        "val_loss_1pass": val.get(1), f"val_loss_{feedback_depth}pass": val.get(feedback_depth),
        "feedback_depth": feedback_depth, "tokens_per_s": trainer.metrics.get("tokens_per_s"),
        "history": [(r.step, r.num_passes, r.loss, r.skipped, r.data_checksum, r.grad_norm)
                    for r in trainer.history],
        "step_seconds": [r.seconds for r in trainer.history], "num_params": n_params,
        "val_history": trainer.metrics.get("val_history", []),  # this invocation's validations
        "probe": trainer.metrics.get("probe"),
    }
    if dist.get_rank() == 0 and trainer.history:  # (history/step_seconds stay out of summary.json)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k not in ("history", "step_seconds", "probe")},
                                                         indent=1, default=str))
    return summary


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


def format_summary(s: dict) -> str:
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


