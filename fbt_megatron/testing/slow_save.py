"""Test entry point: ``fbt`` with a checkpoint save that stalls halfway (to cancel a job mid-save).

    torchrun ... -m fbt_megatron.testing.slow_save train RECIPE ...   (fbt slurm submit --train-module)

With ``FBT_TEST_SLOW_SAVE_STEP=N``, the save of step N writes its tensors into ``step_N.tmp``, then
writes ``RUN_DIR/checkpoints/saving_N`` and sleeps for ten minutes before publishing: a test cancels the
job in that window and checks that ``latest`` still names a complete, loadable checkpoint.
"""

from __future__ import annotations

import os
import sys
import time


def _install() -> None:
    step = int(os.environ.get("FBT_TEST_SLOW_SAVE_STEP", "-1"))
    from fbt_megatron.checkpoint import CheckpointManager

    publish = CheckpointManager._publish

    def slow_publish(self, tmp, final, state, at_step):
        if at_step == step:
            (self.root / f"saving_{at_step}").write_text(str(os.getpid()))
            time.sleep(600)
        return publish(self, tmp, final, state, at_step)

    CheckpointManager._publish = slow_publish


if __name__ == "__main__":
    _install()
    from fbt_megatron.cli import main

    sys.exit(main())
