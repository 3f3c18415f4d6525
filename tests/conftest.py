import os

import pytest

os.environ.setdefault("FBT_DEVICE", "cpu")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture
def single_process():
    """This test process as a world of one (gloo), with Megatron parallel state TP=PP=1."""
    from fbt_megatron import runtime

    runtime.init_distributed()
    runtime.init_parallel_state(runtime.ParallelLayout(), seed=1234)
    yield
    runtime.shutdown()  # tests after this one see no process group
