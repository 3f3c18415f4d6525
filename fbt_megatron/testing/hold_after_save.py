"""Test entry point: ``fbt`` that holds, in an elastic group's first attempt, right after a checkpoint.

    torchrun ... -m fbt_megatron.testing.hold_after_save train RECIPE ...

With ``FBT_TEST_HOLD_AFTER_SAVE_STEP=N`` and ``TORCHELASTIC_RESTART_COUNT`` 0 (torchrun's first attempt),
every rank, once step N's checkpoint is published, writes ``RUN_DIR/checkpoints/held_N`` and sleeps for ten
minutes: a test kills a worker in that window, knowing that checkpoint is complete and no later step has
run (polling the metrics instead raced a tiny model's steps to the end of the run). A restarted group
does not hold.
"""

from __future__ import annotations

import os
import sys
import time


def _install() -> None:
    step = int(os.environ.get("FBT_TEST_HOLD_AFTER_SAVE_STEP", "-1"))
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    from fbt_megatron.checkpoint import CheckpointManager

    publish = CheckpointManager._publish

    def publish_then_hold(self, tmp, final, state, at_step):
        publish(self, tmp, final, state, at_step)
        if at_step == step:
            (self.root / f"held_{at_step}").write_text(str(os.getpid()))
            time.sleep(600)

    CheckpointManager._publish = publish_then_hold


if __name__ == "__main__":
    _install()
    from fbt_megatron.cli import main

    sys.exit(main())
