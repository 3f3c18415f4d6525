"""Preemption signals in the trainer (no SLURM needed): a USR1/TERM finishes the step, every rank stops
after the same step, a checkpoint is saved there, and helper processes forked by the trainer survive
the signal (SLURM delivers it to every process of the job step)."""

import os
import signal
import subprocess
import sys
import time

from tests.support.distributed import run_distributed
from tests.support.training import tiny_recipe, train_fn


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
p.close()
print(alive, T.metrics.get("preempted"))
"""


def test_processes_started_by_the_trainer_survive_the_signal():
    r = subprocess.run([sys.executable, "-c", CHILD_SURVIVES], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "SIGUSR1"], r.stdout


def _file_written_before_start(recipe_data: dict, stop_file: str) -> dict:
    """train_fn in a worker that ignores USR1 (as torchrun's workers do under the batch script's
    `trap "" USR1`): the preemption warning arrives only as the batch script's file, written before the
    first step (e.g. during the health check)."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    os.kill(os.getpid(), signal.SIGUSR1)  # dropped: ignored
    if dist_rank() == 0:
        open(stop_file, "w").write("2026-11-30T00:00:00Z\n")
    return train_fn(recipe_data, env={"FBT_PREEMPT_FILE": stop_file})


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def test_preemption_file_reaches_every_rank_without_any_signal(tmp_path):
    recipe = tiny_recipe(tmp_path, train={"steps": 6}, parallel={"tensor": 1, "zero_stage": 1},
                         checkpoint={"every": 1000, "at_end": True}, eval={"every": 1000, "at_end": True})
    out = run_distributed(_file_written_before_start, 2, recipe, str(tmp_path / "preempt.1.0"))
    for summary in out:  # remembered from before the start: the run stops after its first step
        assert summary["step"] == 1 and summary["preempted"] == "SIGUSR1", summary["stop_reason"]
    assert "preemption file" in out[0]["stop_reason"]  # rank 0 read it; the others learnt it by all-reduce
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000001"


def _signal_while_building(recipe_data: dict) -> dict:
    """train_fn with a USR1 arriving while the model is built (before the first step)."""
    from fbt_megatron.model import fbt_gpt

    original = fbt_gpt.build_model

    def build(*a, **k):
        os.kill(os.getpid(), signal.SIGUSR1)
        return original(*a, **k)

    fbt_gpt.build_model = build
    return train_fn(recipe_data)


def test_usr1_before_the_first_step_is_remembered(tmp_path):
    recipe = tiny_recipe(tmp_path, train={"steps": 6}, checkpoint={"every": 1000, "at_end": True})
    out = run_distributed(_signal_while_building, 1, recipe)[0]
    assert out["step"] == 1 and out["preempted"] == "SIGUSR1", out["stop_reason"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000001"


def _train_then_take_signals(recipe_data: dict) -> dict:
    """train_fn, then what a process that lives on after training (a notebook, a driver script) does
    with SIGTERM/SIGUSR1: its signal mask and handlers, and whether a program it starts afterwards (it
    inherits the mask) ends on SIGTERM as scancel expects."""
    watched = {signal.SIGTERM, signal.SIGUSR1}
    before = {s: signal.getsignal(s) for s in watched}
    train_fn(recipe_data)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, []) & watched
    after = {s: signal.getsignal(s) for s in watched}
    child = subprocess.Popen(["sleep", "60"])
    time.sleep(0.2)
    child.send_signal(signal.SIGTERM)
    try:
        code = child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        child.kill()
        code = "still running 10 s after SIGTERM: " + str(child.wait())
    return {"blocked": sorted(s.name for s in blocked), "handlers_restored": after == before, "child": code}


def test_after_training_the_process_takes_sigterm_and_sigusr1_again(tmp_path):
    """The trainer blocks SIGTERM/SIGUSR1 while it trains; once train() has returned they are unblocked
    and their handlers are the ones from before, so the process (and anything it starts) ends on scancel."""
    recipe = tiny_recipe(tmp_path, train={"steps": 2}, checkpoint={"every": 1000, "at_end": True})
    out = run_distributed(_train_then_take_signals, 1, recipe)[0]
    assert out == {"blocked": [], "handlers_restored": True, "child": -signal.SIGTERM}, out
