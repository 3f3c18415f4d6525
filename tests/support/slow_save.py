"""Test entry point: ``fbt`` whose checkpoint save of one step stalls, before or after publishing.

    torchrun ... -m tests.support.slow_save train RECIPE ...   (fbt slurm submit --train-module)

- ``FBT_TEST_SLOW_SAVE_STEP=N``: the save of step N writes its tensors into ``step_N.tmp``, then writes
  ``RUN_DIR/checkpoints/saving_N`` and sleeps for ten minutes before publishing: a test cancels the job in
  that window and checks that ``latest`` still names a complete, loadable checkpoint.
- ``FBT_TEST_HOLD_AFTER_SAVE_STEP=N``: in torchrun's first attempt (``TORCHELASTIC_RESTART_COUNT`` 0)
  every rank, once step N's checkpoint is published, writes ``RUN_DIR/checkpoints/held_N`` and sleeps
  for ten minutes: a test kills a worker in that window, knowing that checkpoint is complete and no later
  step has run (polling the metrics instead raced a tiny model's steps to the end of the run). A
  restarted group does not hold.
"""

from __future__ import annotations

import os
import sys
import time


def _install() -> None:
    before = int(os.environ.get("FBT_TEST_SLOW_SAVE_STEP", "-1"))
    after = int(os.environ.get("FBT_TEST_HOLD_AFTER_SAVE_STEP", "-1"))
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        after = -1
    from fbt_megatron.checkpoint import CheckpointManager

    publish = CheckpointManager._publish

    def hold(self, marker: str) -> None:
        (self.root / marker).write_text(str(os.getpid()))
        time.sleep(600)

    def slow_publish(self, tmp, final, state, at_step):
        if at_step == before:
            hold(self, f"saving_{at_step}")
        publish(self, tmp, final, state, at_step)
        if at_step == after:
            hold(self, f"held_{at_step}")

    CheckpointManager._publish = slow_publish


if __name__ == "__main__":
    _install()
    from fbt_megatron.cli import main

    sys.exit(main())
