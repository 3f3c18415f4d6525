"""Test entry point: ``fbt`` whose job-array prepare holds one tokenize task part-way.

    python -m tests.support.hold_prepare data prepare-task tokenize ...   (submit-prepare --module)

``FBT_TEST_HOLD_PREPARE_TASK=I`` and ``FBT_TEST_HOLD_PREPARE_SHARDS=K``: array task I, before writing its
(K+1)-th shard, writes ``<out>.array/held_I`` (the PID) and sleeps for ten minutes: a test kills the task
in that window, knowing that exactly K of its shards are finished, then submits again.

    python -m tests.support.hold_prepare data prepare --workers N ...

``FBT_TEST_HOLD_PREPARE_WORKERS=DIR``: every shard writer (a pool worker) writes ``DIR/worker-PID`` and sleeps
for ten minutes instead of writing its shard: a test kills the parent and watches the workers.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def _install() -> None:
    task = os.environ.get("FBT_TEST_HOLD_PREPARE_TASK")
    if task is None or os.environ.get("SLURM_ARRAY_TASK_ID") != task or "tokenize" not in sys.argv:
        return
    shards = int(os.environ.get("FBT_TEST_HOLD_PREPARE_SHARDS", "1"))
    plan = Path(sys.argv[sys.argv.index("--plan") + 1])
    from data_pipeline import prepare

    write, calls = prepare._write_shard, []

    def held(task_args):
        calls.append(task_args[0])
        if len(calls) == shards + 1:
            (plan / f"held_{task}").write_text(str(os.getpid()))
            time.sleep(600)
        return write(task_args)

    prepare._write_shard = held


def _held_worker_shard(task_args):
    """A shard writer that announces its pid and never finishes (a module function: the pool pickles it)."""
    Path(os.environ["FBT_TEST_HOLD_PREPARE_WORKERS"], f"worker-{os.getpid()}").write_text("")
    time.sleep(600)


def _install_workers() -> None:
    if os.environ.get("FBT_TEST_HOLD_PREPARE_WORKERS"):
        from data_pipeline import prepare

        prepare._write_shard = _held_worker_shard


def main() -> int:
    _install()
    _install_workers()
    from fbt_megatron.cli import main as fbt_main

    return fbt_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
