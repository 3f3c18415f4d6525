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


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A one-node SLURM cluster (munge, slurmctld, slurmd) started for this session from a config the
    project writes (fbt_megatron.launch.local_cluster); installs the Debian packages if missing.
    Skips with the reason where the daemons cannot start; in CI (CI=true) that is a failure instead."""
    import subprocess

    from fbt_megatron.launch.local_cluster import ClusterError, LocalCluster

    cluster = LocalCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except (ClusterError, OSError, subprocess.SubprocessError) as e:
        cluster.stop()
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"SLURM daemons did not start in CI: {e}")
        pytest.skip(f"SLURM daemons cannot start on this machine: {e}")
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    yield cluster
    cluster.stop()
    if previous is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = previous
