"""A collective that a peer never joins fails within the test launcher's collective timeout (not pytest's
900 s), naming the rank that waited, the collective and its process group."""

import re
import time

import pytest

from tests.support.distributed import DistributedTestFailure, run_distributed

pytestmark = pytest.mark.slow


def _mismatched_collectives() -> None:
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
        print(f"rank {dist.get_rank()} failed after {time.monotonic() - t0:.0f} s", flush=True)


def test_a_collective_no_peer_joins_fails_naming_group_and_rank(capfd):
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(_mismatched_collectives, 2, collective_timeout_s=10, timeout=300)
    waited = [int(w) for w in re.findall(r"failed after (\d+) s", capfd.readouterr().out)]
    assert len(waited) == 2 and max(waited) < 60, waited  # the start of the processes not counted
    msg = str(info.value)
    # rank 0 waits as long, unless rank 1's failure closes the connection first
    assert "rank 0 waited 10 s in all_reduce over a sub-group group, ranks [0, 1]" in msg or \
        "rank 0 was in all_reduce over a sub-group group, ranks [0, 1] when a peer left" in msg, msg
    assert "rank 1 waited 10 s in barrier over the default (world) group, ranks 0-1" in msg, msg
