"""``<run_dir>/metrics.jsonl``: one JSON line per step and per logged metrics (rank 0)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch.distributed as dist

from fbt_megatron.files import write_text_atomic
from fbt_megatron.train.callbacks.base import Logger, is_rank0, step_metrics


class MetricsFile(Logger):
    """One JSON line per step in ``<run_dir>/metrics.jsonl`` (rank 0): step, passes, loss, the global
    batch's data checksum, counters, which (re)start of the job wrote it, and every scalar the other
    loggers get (``train/...``, ``feedback/...``, ``perf/...``). Metrics logged outside a step (the
    validation losses, ``val/loss_kK``) get a line of their own with ``"event": "metrics"``.
    ``fbt slurm status`` reads it; the preemption and elastic tests compare its sample stream with an
    uninterrupted run's. At the start of a (resumed) run the rows of steps after the resumed one are
    removed: those steps are trained again, and each step keeps one row."""

    priority = 50

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

    def on_train_start(self, trainer) -> None:
        if is_rank0():
            drop_rows_after(self.path, trainer.state.step)

    def on_step_end(self, trainer, r) -> None:
        if not is_rank0():
            return
        s = trainer.state
        self._write({"step": s.step, "passes": r.num_passes, "loss": r.loss, "skipped": r.skipped,
                     "data_checksum": r.data_checksum, "consumed_sequences": s.consumed_sequences,
                     "tokens_seen": s.tokens_seen, "seconds": r.seconds, "time": time.time(), **self.launch,
                     **step_metrics(trainer, r)})

    def log_metrics(self, trainer, metrics: dict) -> None:
        if is_rank0():
            self._write({"event": "metrics", "step": trainer.state.step, "tokens_seen": trainer.state.tokens_seen,
                         "time": time.time(), **metrics})


def drop_rows_after(path: Path, step: int) -> int:
    """Rewrite the metrics file without the rows of steps after ``step`` (the run resumes there and trains
    them again) and without lines cut by a kill; atomic (a temporary file renamed over it). Returns how
    many lines went."""
    path = Path(path)
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(row, dict) or row.get("step", 0) <= step:
            kept.append(line)
    if len(kept) < len(lines):
        write_text_atomic(path, "".join(line + "\n" for line in kept))
    return len(lines) - len(kept)


def read_rows(path: Path) -> list[dict]:
    """The rows of a JSON-lines file written by appending (this logger's metrics.jsonl, the launcher's
    slurm/jobs.jsonl): none when it does not exist; a line cut by a kill is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill
            continue
    return rows


def read_val_history(path: Path) -> list[dict]:
    """Every validation in a metrics file, by step: ``[{"step", "tokens", "loss": {"K": loss}}]``, the
    shape of ``summary.json``'s ``val_history``. The file spans every invocation of the run (a summary
    holds only its own invocation's); a step validated again after a resume keeps its latest line, and a
    line cut by a kill is skipped."""
    by_step: dict[int, dict] = {}
    for row in read_rows(path):
        losses = {k[len("val/loss_k"):]: v for k, v in row.items() if k.startswith("val/loss_k")}
        if row.get("event") == "metrics" and losses:
            by_step[row["step"]] = {"step": row["step"], "tokens": row["tokens_seen"], "loss": losses}
    return [by_step[k] for k in sorted(by_step)]
