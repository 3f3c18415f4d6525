"""A process not started by torchrun is a world of one: it needs no port, so two runs started side by side
cannot race for one (a port picked free can be taken before it is bound)."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_world_of_one_starts_while_every_picked_port_is_taken():
    code = textwrap.dedent("""
        import socket
        import torch.distributed as dist
        import fbt_megatron.runtime as runtime
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        held.listen()
        runtime._free_port = lambda: held.getsockname()[1]  # another run took it between the pick and the bind
        runtime.init_distributed(timeout_s=20)
        runtime.init_parallel_state(runtime.ParallelLayout())
        print("world", dist.get_world_size())
        runtime.shutdown()
    """)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "world 1" in done.stdout


def test_the_same_layout_again_keeps_megatrons_groups(single_process):
    """A process that loads several models (the study's read-outs) sets the layout once per model. Megatron's
    destroy drops its groups without closing them, so a new set each time would leave the old ones open;
    the same layout keeps the groups it made, and still seeds as asked. Another layout makes new ones and
    closes the old ones."""
    import torch
    from megatron.core import parallel_state

    from fbt_megatron import runtime

    group = parallel_state.get_data_parallel_group()
    runtime.init_parallel_state(runtime.ParallelLayout(), seed=7)
    assert parallel_state.get_data_parallel_group() is group
    drawn = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(drawn, torch.rand(3))
    open_groups = len(torch.distributed.distributed_c10d._world.pg_map)
    runtime.init_parallel_state(runtime.ParallelLayout(), seed=7, timeout_s=60)  # another collective timeout
    assert parallel_state.get_data_parallel_group() is not group
    # the old set is closed: as many groups open as before, none of them the old ones
    assert len(torch.distributed.distributed_c10d._world.pg_map) == open_groups
    assert group not in torch.distributed.distributed_c10d._world.pg_map
    runtime.init_parallel_state(runtime.ParallelLayout(), seed=7, timeout_s=90)
    assert len(torch.distributed.distributed_c10d._world.pg_map) == open_groups


def test_megatrons_tensor_parallel_gather_warns_nothing(single_process):
    """torch deprecates all_gather_into_tensor, which megatron's tensor-parallel gathers call on every rank:
    a warning per rank per run that no user can act on is silenced; the call itself still works."""
    import warnings

    import torch
    import torch.distributed as dist

    from fbt_megatron import runtime

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        runtime.quiet_known_warnings()
        out = torch.empty(4)
        dist.all_gather_into_tensor(out, torch.arange(4.0))
    assert [str(w.message) for w in seen if "all_gather_into_tensor" in str(w.message)] == []
    assert torch.equal(out, torch.arange(4.0))
