"""``python -m fbt_megatron.launch.local_cluster start|stop DIR`` writes only into a DIR that is new, empty
or an earlier cluster's; a start while DIR's cluster runs and a stop of a DIR without a cluster are one
sentence. None of these cases starts a daemon, so they run anywhere."""

import json
import os
from pathlib import Path

import pytest

from fbt_megatron.launch import local_cluster
from fbt_megatron.launch.local_cluster import CONF_HEADER, LocalCluster


def listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def no_daemons(monkeypatch):
    """A start that gets past the checks fails here, before the packages or any daemon."""
    def start(self, timeout=60.0):
        raise AssertionError("the checks let this start through")
    monkeypatch.setattr(LocalCluster, "start", start)


def test_start_refuses_a_dir_holding_your_files(tmp_path, capsys, no_daemons):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "log").mkdir()
    before = listing(tmp_path)
    assert local_cluster.main(["start", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"local_cluster: error: DIR {tmp_path} holds notes.txt, which local_cluster did not write: nothing was "
        "changed; choose a new or empty directory, or move it away")
    assert listing(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["log", "notes.txt"]


def test_start_refuses_your_own_slurm_conf(tmp_path, capsys, no_daemons):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "slurm.conf").write_text("ClusterName=mine\n")
    assert local_cluster.main(["start", str(tmp_path)]) == 2
    assert "holds slurm.conf, which local_cluster did not write" in capsys.readouterr().err
    assert listing(tmp_path) == {"etc/slurm.conf": b"ClusterName=mine\n"}


def test_start_refuses_while_the_dirs_cluster_runs(tmp_path, capsys, no_daemons):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "slurm.conf").write_text(CONF_HEADER + "\n")
    me = Path(f"/proc/{os.getpid()}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    (tmp_path / "pids.json").write_text(json.dumps({"pids": {"slurmctld": os.getpid()}, "cmdlines": {"slurmctld": me}}))
    assert local_cluster.main(["start", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"local_cluster: error: a cluster is running in {tmp_path} (slurmctld): stop it first with "
        f"python -m fbt_megatron.launch.local_cluster stop {tmp_path}")


def test_a_stopped_clusters_dir_is_started_again(tmp_path, no_daemons):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "slurm.conf").write_text(CONF_HEADER + "\nClusterName=fbtlocal\n")
    (tmp_path / "log").mkdir()
    (tmp_path / "pids.json").write_text(json.dumps({"pids": {"slurmctld": 2 ** 22 + 1}, "cmdlines": {"slurmctld": "x"}}))
    with pytest.raises(AssertionError, match="the checks let this start through"):
        local_cluster.main(["start", str(tmp_path)])
    with pytest.raises(AssertionError, match="the checks let this start through"):
        local_cluster.main(["start", str(tmp_path / "new")])


def test_stop_without_a_cluster_is_one_sentence(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert local_cluster.main(["stop", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"local_cluster: error: {tmp_path} holds no local cluster (no pids.json): nothing to stop")
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]
    (tmp_path / "pids.json").write_text("my own json\n")
    assert local_cluster.main(["stop", str(tmp_path)]) == 2
    assert "pids.json is not a record local_cluster wrote: nothing was changed" in capsys.readouterr().err


def test_a_start_that_fails_before_its_daemons_says_why(tmp_path, capsys, monkeypatch):
    """Missing packages (or any failure before the first daemon) into a new DIR: that sentence, exit 1, not a
    FileNotFoundError from the clean-up writing pids.json into a DIR that was never made."""
    def no_packages(log=print):
        raise local_cluster.ClusterError("SLURM packages ['munge'] are missing and installing them needs root")

    monkeypatch.setattr(local_cluster, "install_packages", no_packages)
    assert local_cluster.main(["start", str(tmp_path / "new")]) == 1
    assert capsys.readouterr().err.strip() == (
        "local_cluster: error: SLURM packages ['munge'] are missing and installing them needs root")
    assert not (tmp_path / "new").exists()
