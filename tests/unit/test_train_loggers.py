"""Every logger gets every metric: the validation losses and the per-step scalars reach TensorBoard,
W&B and the metrics file alike (before, only TensorBoard saw the validation loss)."""

from __future__ import annotations

import json
import sys
import types

from fbt_megatron.train import callbacks as cb
from fbt_megatron.train.train_step import StepResult
from fbt_megatron.train.trainer import Trainer


class FakeWandbRun:
    def __init__(self):
        self.rows: list[tuple[int, dict]] = []

    def log(self, data, step=None):
        self.rows.append((step, dict(data)))

    def finish(self):
        pass


def _trainer(tmp_path, callbacks):
    def step_fn(step, batch, lr):
        passes = 1 if step < 2 else 2
        return StepResult(step=step, num_passes=passes, loss=3.0 - 0.1 * step, tokens=64, skipped=False,
                          grad_norm=1.5, lr=lr, residuals=[0.25] if passes == 2 else [])

    val = {1: 4.0, 2: 3.5}
    validation = cb.Validation(2, lambda k: val[k], [1, 2], at_end=True)
    return Trainer(step_fn=step_fn, batches=iter(range(100)), micro_batches_per_step=1, lr_fn=lambda s: 1e-3,
                   total_steps=3, global_batch_size=4, callbacks=[validation, *callbacks], log=lambda *a: None)


def test_validation_and_step_scalars_reach_every_logger(tmp_path, monkeypatch):
    run = FakeWandbRun()
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: run))
    metrics_file = tmp_path / "metrics.jsonl"
    _trainer(tmp_path, [cb.TensorBoardLogger(tmp_path / "tb"), cb.WandbLogger("p", "n", {}),
                        cb.MetricsFile(metrics_file)]).fit()

    # validation every 2 steps -> at step 2, and at the end (step 3)
    expect_val = {(2, "val/loss_k1"): 4.0, (2, "val/loss_k2"): 3.5, (3, "val/loss_k1"): 4.0, (3, "val/loss_k2"): 3.5}
    step_keys = {"train/loss", "train/lr", "train/grad_norm", "train/num_passes", "perf/tokens_per_s"}

    wandb_seen = {(step, k): v for step, row in run.rows for k, v in row.items()}
    assert {k: wandb_seen.get(k) for k in expect_val} == expect_val
    assert wandb_seen[(3, "feedback/residual_pass2")] == 0.25 and wandb_seen[(1, "train/loss_k1")] == 3.0
    assert all((s, k) in wandb_seen for s in (1, 2, 3) for k in step_keys)

    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    file_seen = {(r["step"], k): v for r in rows for k, v in r.items()}
    assert {k: file_seen.get(k) for k in expect_val} == expect_val
    assert all((s, k) in file_seen for s in (1, 2, 3) for k in step_keys)
    assert [r["step"] for r in rows if "event" not in r] == [1, 2, 3]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tb_seen = {(e.step, tag): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    assert {k: tb_seen.get(k) for k in expect_val} == expect_val
    assert all((s, k) in tb_seen for s in (1, 2, 3) for k in step_keys)


def test_status_reads_step_rows_and_the_last_validation(tmp_path):
    from fbt_megatron.launch.status import format_status, status

    _trainer(tmp_path, [cb.MetricsFile(tmp_path / "metrics.jsonl")]).fit()
    s = status(tmp_path)
    assert s["step"] == 3 and s["last_loss"] == 3.0 - 0.1 * 2
    assert "validation @ step 3: 1-pass 4.0000 2-pass 3.5000" in format_status(s)
