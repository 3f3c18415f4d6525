"""A collective that a peer never joins fails within the test launcher's collective timeout (not pytest's
900 s), naming the rank that waited, the collective and its process group."""

import time

import pytest

from tests.support.distributed import DistributedTestFailure, run_distributed

pytestmark = pytest.mark.slow


def _mismatched_collectives(out_dir: str) -> None:
    import os

    import torch
    import torch.distributed as dist

    sub = dist.new_group([0, 1])  # every rank creates it; only rank 0 then uses it
    t0 = time.monotonic()
    try:
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1), group=sub)
        else:
            dist.barrier()
    finally:
        # a file, not stdout: the workers come from a forkserver whose stdout is the one pytest captured when
        # the first test of the session started it, not this test's capfd
        with open(os.path.join(out_dir, f"rank{dist.get_rank()}.txt"), "w") as f:
            f.write(f"{time.monotonic() - t0:.0f}")


def test_a_collective_no_peer_joins_fails_naming_group_and_rank(tmp_path):
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(_mismatched_collectives, 2, str(tmp_path), collective_timeout_s=10, timeout=300)
    waited = [int(f.read_text()) for f in sorted(tmp_path.glob("rank*.txt"))]
    assert len(waited) == 2 and max(waited) < 60, waited  # the start of the processes not counted
    msg = str(info.value)
    # rank 0 waits as long, unless rank 1's failure closes the connection first
    assert "rank 0 waited 10 s in all_reduce over a sub-group group, ranks [0, 1]" in msg or \
        "rank 0 was in all_reduce over a sub-group group, ranks [0, 1] when a peer left" in msg, msg
    assert "rank 1 waited 10 s in barrier over the default (world) group, ranks 0-1" in msg, msg
