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
