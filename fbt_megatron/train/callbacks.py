"""Pluggable pieces of a run: console and TensorBoard logging, W&B, validation, checkpoints, profiling,
a per-step metrics file and preemption signals."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fbt_megatron.logs import printer
from fbt_megatron.train.trainer import Callback

log_info = printer(logging.getLogger(__name__))


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def model_flops_per_token(matmul_params: int, num_layers: int, hidden: int, seq_len: int, passes: int,
                          grad_mode: str = "all", fusion_params: int = 0, fused_first_pass: bool = False) -> float:
    """Training FLOPs per token of a ``passes``-pass step, counted as ``fbt plan`` counts them: a
    forward of the stack F = 2 N_mm + 4 L S h (matmul parameters without the fusion; QK^T and AV over
    the full square) and of the fusion 2 x ``fusion_params`` (W_U, W_G), combined by
    ``passes.step_flops`` (the fusion only in the passes that read a state)."""
    from fbt_megatron.passes import step_flops

    stack = 2.0 * matmul_params + 4.0 * num_layers * hidden * seq_len
    return step_flops(passes, grad_mode, stack, 2.0 * fusion_params, fused_first_pass)


class ConsoleLogger(Callback):
    """Every N steps: loss, loss by pass count, lr, grad norm, tokens/s, MFU, pass mix so far."""

    def __init__(self, every: int, flops_fn=None, peak_flops: float | None = None, world_size: int = 1,
                 print_fn=log_info):
        self.every, self.flops_fn, self.peak_flops = every, flops_fn, peak_flops
        self.world_size, self.print = world_size, print_fn
        self._window: list = []

    def on_step_end(self, trainer, r) -> None:
        self._window.append(r)
        if trainer.state.step % self.every and trainer.state.step != trainer.total_steps:
            return
        w, self._window = self._window, []
        good = [x for x in w if not x.skipped]
        secs = sum(x.seconds for x in w) or 1e-9
        tokens = sum(x.tokens for x in w)
        by_k: dict[int, list[float]] = {}
        for x in good:
            by_k.setdefault(x.num_passes, []).append(x.loss)
        split = " ".join(f"k{k}={sum(v) / len(v):.4f}" for k, v in sorted(by_k.items()))
        loss = sum(x.loss for x in good) / len(good) if good else float("nan")
        mix = trainer.state.pass_counts
        total = sum(mix.values()) or 1
        mix_s = "/".join(f"{k}:{100 * v / total:.0f}%" for k, v in sorted(mix.items()))
        gn = [x.grad_norm for x in good if x.grad_norm is not None]
        line = (f"step {trainer.state.step:>6d}/{trainer.total_steps} | loss {loss:.4f} [{split}] | "
                f"lr {w[-1].lr:.3e} | gnorm {(gn[-1] if gn else float('nan')):.3f} | "
                f"{tokens / secs:,.0f} tok/s")
        if self.peak_flops and self.flops_fn:
            flops = sum(self.flops_fn(x.num_passes) * x.tokens for x in w)
            line += f" | MFU {100 * flops / secs / (self.peak_flops * self.world_size):.2f}%"
        if w[-1].residuals:
            line += " | resid " + ",".join(f"{v:.3f}" for v in w[-1].residuals)
        line += f" | passes {mix_s}"
        if trainer.state.skipped_steps:
            line += f" | skipped {trainer.state.skipped_steps}"
        trainer.metrics["tokens_per_s"] = tokens / secs
        if is_rank0():
            self.print(line, flush=True)


def step_metrics(trainer, r) -> dict[str, float]:
    """The scalars of one step, under the names every logger uses (TensorBoard, W&B, metrics file)."""
    out: dict[str, float] = {}
    if not r.skipped:
        out["train/loss"] = r.loss
        out[f"train/loss_k{r.num_passes}"] = r.loss
        if r.grad_norm is not None:
            out["train/grad_norm"] = r.grad_norm
        for i, v in enumerate(r.residuals):
            out[f"feedback/residual_pass{i + 2}"] = v
    out["train/lr"] = r.lr
    out["train/num_passes"] = r.num_passes
    out["train/skipped_steps"] = trainer.state.skipped_steps
    if r.seconds > 0:
        out["perf/tokens_per_s"] = r.tokens / r.seconds
    return out


class TensorBoardLogger(Callback):
    def __init__(self, log_dir: Path, every: int = 1):
        self.log_dir, self.every, self.writer = Path(log_dir), every, None

    def on_train_start(self, trainer) -> None:
        if is_rank0():
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.log_dir))

    def on_step_end(self, trainer, r) -> None:
        self.on_metrics(trainer, step_metrics(trainer, r))

    def on_metrics(self, trainer, metrics: dict) -> None:
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, trainer.state.step)

    def on_train_end(self, trainer) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbLogger(Callback):
    """Optional (logging.wandb: true); needs the ``wandb`` package."""

    def __init__(self, project: str, name: str, config: dict):
        self.project, self.name, self.config, self.run = project, name, config, None

    def on_train_start(self, trainer) -> None:
        if is_rank0():
            import wandb

            self.run = wandb.init(project=self.project, name=self.name, config=self.config)

    def on_step_end(self, trainer, r) -> None:
        self.on_metrics(trainer, step_metrics(trainer, r))

    def on_metrics(self, trainer, metrics: dict) -> None:
        if self.run is not None:
            self.run.log(dict(metrics), step=trainer.state.step)

    def on_train_end(self, trainer) -> None:
        if self.run is not None:
            self.run.finish()


class Validation(Callback):
    """Validation loss every N steps with 1 pass and with the feedback depth."""

    def __init__(self, every: int, evaluate_fn, passes: list[int], at_end: bool = True, print_fn=log_info):
        self.every, self.evaluate_fn, self.passes = every, evaluate_fn, sorted(set(passes))
        self.at_end, self.print = at_end, print_fn
        self._last_step = None

    def run(self, trainer) -> dict[int, float]:
        losses = {k: self.evaluate_fn(k) for k in self.passes}
        self._last_step = trainer.state.step
        trainer.metrics["val_loss"] = losses
        trainer.metrics.setdefault("val_history", []).append(
            {"step": trainer.state.step, "tokens": trainer.state.tokens_seen, "loss": losses})
        trainer.log_metrics({f"val/loss_k{k}": v for k, v in losses.items()})  # to every logger
        if is_rank0():
            body = " ".join(f"{k}-pass {v:.4f}" for k, v in losses.items())
            self.print(f"validation @ step {trainer.state.step}: {body}", flush=True)
        return losses

    def on_step_end(self, trainer, r) -> None:
        if trainer.state.step % self.every == 0:
            self.run(trainer)

    def on_train_end(self, trainer) -> None:
        # A preempted run saves and leaves at once (its job is about to be killed or requeued).
        if self.at_end and self._last_step != trainer.state.step and not trainer.metrics.get("preempted"):
            self.run(trainer)


class Preemption(Callback):
    """SIGUSR1 (SLURM's warning before the time limit, ``--signal=B:USR1@N``) or SIGTERM (scancel, node
    drain): finish the step in flight, then stop; the :class:`Checkpointer` after this callback saves
    because ``stop_reason`` is set. All ranks agree on the stop step (max-reduce of the flag every
    step), so a signal that reaches the ranks a few milliseconds apart stops them after the same step.

    Two ways in, so that the warning does not depend on how the cluster delivers signals:
    - ``stop_file``: the batch script's USR1 trap writes it (``$FBT_PREEMPT_FILE``); rank 0 looks for
      it at every step end. torchrun starts its workers in new sessions, so where the process tracker
      signals only the step's process group (``proctrack/pgid``) the signal never reaches them, and a
      worker that inherited an ignored USR1 (the batch script's torchrun ignores it) would drop one;
      the file is seen either way, also when it was written before training started.
    - the signals themselves, *blocked* in the training thread and polled with ``sigpending`` at each
      step end (a Python handler also catches one that lands on another thread). :meth:`arm` is called
      as early as the run starts (before the model is built), so a signal that arrives before the first
      step stays pending instead of killing the process or being lost. Why blocked: SLURM delivers a
      step signal to every process of the step, and helper processes forked by the trainer (megatron's
      checkpoint writers) inherit the mask; with a handler alone they would reset to the default action
      and die on USR1 in the middle of the save this signal asks for."""

    SIGNALS = ("SIGUSR1", "SIGTERM")

    def __init__(self, device=None, signals=SIGNALS, print_fn=log_info, stop_file: str | Path | None = None):
        self.device, self.signals, self.print = device, [getattr(signal, s) for s in signals], print_fn
        self.stop_file = Path(stop_file) if stop_file else None
        self.received = 0
        self.source = ""
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        self.received = self.received or signum

    def arm(self) -> None:
        """Start catching the signals (idempotent; from the main thread only)."""
        if not self._previous and threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
            signal.pthread_sigmask(signal.SIG_BLOCK, self.signals)

    def on_train_start(self, trainer) -> None:
        self.arm()

    def _poll(self) -> int:
        if not self.received and self._previous:
            pending = signal.sigpending() & set(self.signals)
            if pending:
                self.received = min(pending)  # stays pending (blocked) until on_train_end
        if not self.received and self.stop_file is not None and is_rank0() and self.stop_file.exists():
            self.received, self.source = signal.SIGUSR1, f" (preemption file {self.stop_file})"
        return self.received

    def on_step_end(self, trainer, r) -> None:
        flag = self._poll()
        if dist.is_initialized():
            t = torch.tensor([flag], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = int(t.item())
        if flag and trainer.stop_reason is None:
            name = signal.Signals(flag).name
            trainer.metrics["preempted"] = name
            trainer.stop_reason = (f"preempted: {name} received{self.source}; stopped after step {trainer.state.step} "
                                   "with a checkpoint (a relaunch resumes from it)")
            if is_rank0():
                self.print(trainer.stop_reason, flush=True)

    def release(self) -> None:
        """Called by the run after the last save has finished (not at train end: a SIGTERM during the
        final checkpoint must not kill the process halfway through it)."""
        if self._previous:
            # Unblock first: a pending signal then runs our handler (a no-op flag), not the old action.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)
            self._previous.clear()


class MetricsFile(Callback):
    """One JSON line per step in ``<run_dir>/metrics.jsonl`` (rank 0): step, passes, loss, the global
    batch's data checksum, counters, which (re)start of the job wrote it, and every scalar the other
    loggers get (``train/...``, ``feedback/...``, ``perf/...``). Metrics logged outside a step (the
    validation losses, ``val/loss_kK``) get a line of their own with ``"event": "metrics"``.
    ``fbt slurm status`` reads it; the preemption and elastic tests compare its sample stream with an
    uninterrupted run's."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.launch = {k: os.environ[v] for k, v in (("slurm_job", "SLURM_JOB_ID"),
                                                     ("slurm_restart", "SLURM_RESTART_COUNT"),
                                                     ("elastic_restart", "TORCHELASTIC_RESTART_COUNT"))
                       if v in os.environ}
        self.launch["world_size"] = dist.get_world_size() if dist.is_initialized() else 1

    def _write(self, row: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def on_step_end(self, trainer, r) -> None:
        if not is_rank0():
            return
        s = trainer.state
        self._write({"step": s.step, "passes": r.num_passes, "loss": r.loss, "skipped": r.skipped,
                     "data_checksum": r.data_checksum, "consumed_sequences": s.consumed_sequences,
                     "tokens_seen": s.tokens_seen, "seconds": r.seconds, "time": time.time(), **self.launch,
                     **step_metrics(trainer, r)})

    def on_metrics(self, trainer, metrics: dict) -> None:
        if is_rank0():
            self._write({"event": "metrics", "step": trainer.state.step, "tokens_seen": trainer.state.tokens_seen,
                         "time": time.time(), **metrics})


class Checkpointer(Callback):
    """Saves every N steps and at the end; ``poll_fn`` runs at every step end so that an async save is
    published as soon as its write has completed (not at the next save)."""

    def __init__(self, save_fn, every: int, at_end: bool = True, print_fn=log_info, async_save: bool = False,
                 poll_fn=None):
        self.save_fn, self.every, self.at_end, self.print = save_fn, every, at_end, print_fn
        self.async_save, self.poll_fn = async_save, poll_fn
        self._last_step = None

    def save(self, trainer) -> None:
        path = self.save_fn(trainer.state)
        self._last_step = trainer.state.step
        trainer.metrics["checkpoint"] = str(path)
        if is_rank0():
            self.print(f"checkpoint {'scheduled' if getattr(self, 'async_save', False) else 'saved'}: {path}", flush=True)

    def on_step_end(self, trainer, r) -> None:
        if self.poll_fn is not None:
            self.poll_fn()
        if trainer.state.step % self.every == 0 or (trainer.stop_reason and self._last_step != trainer.state.step):
            self.save(trainer)

    def on_train_end(self, trainer) -> None:
        if (self.at_end or trainer.stop_reason) and self._last_step != trainer.state.step:
            self.save(trainer)


class Profiler(Callback):
    """torch.profiler over ``num_steps`` steps from ``start_step``; a Chrome trace per rank."""

    def __init__(self, out_dir: Path, start_step: int, num_steps: int):
        self.out_dir, self.start, self.stop_at = Path(out_dir), start_step, start_step + num_steps
        self.prof = None

    def on_step_end(self, trainer, r) -> None:
        import torch.profiler as tp

        s = trainer.state.step
        if s == self.start and self.prof is None:
            acts = [tp.ProfilerActivity.CPU]
            if __import__("torch").cuda.is_available():
                acts.append(tp.ProfilerActivity.CUDA)
            self.prof = tp.profile(activities=acts, record_shapes=False)
            self.prof.__enter__()
        elif s == self.stop_at and self.prof is not None:
            self._finish()

    def _finish(self) -> None:
        self.prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.prof.export_chrome_trace(str(self.out_dir / f"trace_rank{rank}.json"))
        self.prof = None

    def on_train_end(self, trainer) -> None:
        if self.prof is not None:
            self._finish()


def fmt(x: float) -> str:
    return "nan" if x is None or not math.isfinite(x) else f"{x:.4f}"

