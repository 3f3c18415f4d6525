"""Preemption signals in the trainer (no SLURM needed): a USR1/TERM finishes the step, every rank stops
after the same step, a checkpoint is saved there, and helper processes forked by the trainer survive
the signal (SLURM delivers it to every process of the job step)."""

import os
import signal
import subprocess
import sys
import time

from fbt_megatron.testing.distributed import run_distributed
from fbt_megatron.train.testing import tiny_recipe, train_fn


def _signal_at(recipe_data: dict, step: int, rank: int, signame: str) -> dict:
    """train_fn, with rank ``rank`` sending itself ``signame`` during step ``step``."""
    import torch.distributed as dist

    from fbt_megatron.train import train_step

    original = train_step.FBTTrainStep.__call__

    def call(self, s, batches, lr):
        if s == step and dist.get_rank() == rank:
            os.kill(os.getpid(), getattr(signal, signame))
        return original(self, s, batches, lr)

    train_step.FBTTrainStep.__call__ = call
    return train_fn(recipe_data)


def test_signal_on_one_rank_stops_every_rank_after_that_step_with_a_checkpoint(tmp_path):
    recipe = tiny_recipe(tmp_path, train={"steps": 8}, parallel={"tensor": 2, "zero_stage": 1},
                         checkpoint={"every": 1000, "at_end": True}, eval={"every": 1000, "at_end": True})
    out = run_distributed(_signal_at, 2, recipe, 2, 1, "SIGUSR1")
    for summary in out:  # the signal arrived during step index 2 on rank 1 only
        assert summary["step"] == 3 and summary["preempted"] == "SIGUSR1", summary["stop_reason"]
        assert summary["val_loss_1pass"] is None  # no end-of-run validation when preempted
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000003"


def test_sigterm_single_process(tmp_path):
    recipe = tiny_recipe(tmp_path, train={"steps": 8}, checkpoint={"every": 1000, "at_end": True})
    out = run_distributed(_signal_at, 1, recipe, 4, 0, "SIGTERM")[0]
    assert out["step"] == 5 and out["preempted"] == "SIGTERM"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000005"


CHILD_SURVIVES = r"""
import os, signal, subprocess, sys, time
from fbt_megatron.train.callbacks import Preemption
class T:  # a stand-in trainer
    stop_reason = None; metrics = {}
    class state: step = 1
p = Preemption(print_fn=lambda *a, **k: None)
p.on_train_start(T)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # like a checkpoint writer
time.sleep(0.5)
os.kill(child.pid, signal.SIGUSR1)   # SLURM signals every process of the step
os.kill(os.getpid(), signal.SIGUSR1)
time.sleep(1.0)
alive = child.poll() is None
child.kill(); child.wait()
p.on_step_end(T, None)
p.release()
print(alive, T.metrics.get("preempted"))
"""


def test_processes_started_by_the_trainer_survive_the_signal():
    r = subprocess.run([sys.executable, "-c", CHILD_SURVIVES], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "SIGUSR1"], r.stdout
