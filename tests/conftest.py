import os
import sys

import pytest


def pytest_configure(config):
    """The CPU path for the suite; CUDA kept for a session of GPU tests alone (``pytest -m gpu``, what
    ``make gpu-check`` runs) on a CUDA machine (``tests/support/gpu.py``). Runs before any test
    module imports fbt_megatron or DeepSpeed."""
    import torch

    from fbt_megatron import runtime
    from tests.support.gpu import session_env

    config.addinivalue_line("markers", "gpu: needs a CUDA device; runs under `pytest -m gpu` (make gpu-check), "
                            "skips with the reason elsewhere")
    os.environ.update(session_env(config.option.markexpr or "", os.environ, torch.cuda.is_available()))
    share_cores_among_workers()
    runtime.quiet_known_warnings()  # again, now that the device is decided (the package's import ran it)


def share_cores_among_workers() -> None:
    """Under ``pytest -n N`` each worker, and the processes it starts (``fbt train`` reads
    ``FBT_CPU_THREADS``, other programs ``OMP_NUM_THREADS``), takes its share of the cores: N workers
    that each take them all thrash."""
    import torch

    from fbt_megatron.runtime import CPU_THREADS_ENV, cpu_share, cpu_threads

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if workers > 1:
        share = cpu_share(workers)
        for name in (CPU_THREADS_ENV, "OMP_NUM_THREADS"):
            os.environ.setdefault(name, str(share))
        torch.set_num_threads(cpu_threads(workers))


@pytest.fixture
def cuda_device():
    """For a GPU test: skips, saying why, where this session cannot run CUDA (decided when the test runs)."""
    import torch

    from fbt_megatron import runtime
    from tests.support.gpu import gpu_skip_reason

    reason = gpu_skip_reason(runtime.use_cuda(), torch.cuda.is_available())
    if reason:
        pytest.skip(reason)


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


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``make test`` runs ``-n 2 --dist loadgroup``): the tests of one integration module
    run on one worker (its module-scoped fixtures, e.g. a trained run, are built once), and every test of the
    one-node SLURM cluster on the same worker (one cluster for the session, its packages installed once). Unit
    tests spread freely."""
    for item in items:
        path = item.nodeid.split("::")[0]
        if item.get_closest_marker("slurm") or "slurm_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif path.startswith("tests/integration/"):
            item.add_marker(pytest.mark.xdist_group(path))


def pytest_collection_finish(session):
    """On an xdist worker under ``--dist loadgroup``: refuse to run when xdist dropped the groups (it does so
    silently with pytest 9.2, pytest-dev/pytest-xdist#1386), since two workers would then share a module's
    fixtures or both start the SLURM cluster."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not session.config.getvalue("loadgroup"):
        return
    lost = [i.nodeid for i in session.items if any(i.iter_markers("xdist_group")) and "@" not in i.nodeid]
    if lost:
        message = (f"pytest-xdist ignored the xdist_group marks of {len(lost)} tests (e.g. {lost[0]}): pytest 9.2 "
                   "breaks --dist loadgroup (pytest-dev/pytest-xdist#1386); install pytest<9.2")
        print(message, file=sys.__stderr__, flush=True)  # the controller shows only an INTERNALERROR
        raise pytest.UsageError(message)
