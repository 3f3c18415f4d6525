"""vLLM's distributed state for a side script without an engine: a world of one process over gloo on a free
loopback port, tensor- and pipeline-parallel size 1, inside the current vLLM config (a default one).
Imported by the side scripts beside it (run as scripts with the vLLM venv's python, their folder on sys.path)."""

import contextlib
import socket

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel


@contextlib.contextmanager
def one_rank_world():
    """vLLM's parallel state set up for one rank, under a default ``VllmConfig`` inside the block; the parallel
    state stays after it (nothing tears it down), so a script may build its own configs after the block."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
        yield
