"""A one-node SLURM cluster from Debian's packages, for tests, CI and trying the launcher locally.

    python -m fbt_megatron.launch.local_cluster start DIR   # prints `export SLURM_CONF=...`
    python -m fbt_megatron.launch.local_cluster stop DIR

What it does (facts measured on these machines: ../shared design notes §5):
- installs ``munge slurmctld slurmd slurm-client`` with apt if they are missing (a temporary
  ``policy-rc.d`` keeps the package scripts from starting system daemons);
- writes a munge key, ``slurm.conf`` and state/spool/log directories under DIR; ports are picked free
  so several clusters (or a system one) can coexist;
- starts munged, slurmctld and slurmd in the foreground under ``setsid`` (the recorded PID is the
  daemon's own) and waits until the node is idle and ``srun -n1 true`` succeeds;
- stop: cancels every job first (stopping slurmd would orphan them), then stops only the recorded
  PIDs, each after checking /proc that it is still the same program.
- DIR must be new, empty or an earlier cluster's (stopped): anything else there is refused before
  anything is written, as is a start while DIR's cluster runs or a stop of a DIR that holds none.

Requeue-latency settings (``cred_expire=10``, ``bf_interval=1,sched_interval=2``) cut a requeued job's
restart from minutes to seconds (docs/results/benchmarks.md); ``KillWait`` is short so a cancel's
SIGTERM->SIGKILL gap is quick.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from data_pipeline.output_dir import check_own_files, earlier_output
from fbt_megatron.errors import UserError, report

PACKAGES = ["munge", "slurmctld", "slurmd", "slurm-client"]
DAEMONS = {"munged": "/usr/sbin/munged", "slurmctld": "/usr/sbin/slurmctld", "slurmd": "/usr/sbin/slurmd"}


CONF_HEADER = "# written by fbt_megatron.launch.local_cluster: a one-node test cluster"
ENTRIES = ("etc", "munge", "state", "spool", "log", "run", "pids.json")  # what start writes under DIR


class ClusterError(RuntimeError):
    pass


class ClusterDirError(UserError):
    """DIR is not this tool's to write, or holds no cluster to stop: nothing was changed."""


def missing_packages() -> list[str]:
    need = {"munge": "munged", "slurmctld": "slurmctld", "slurmd": "slurmd", "slurm-client": "sbatch"}
    return [pkg for pkg, exe in need.items() if shutil.which(exe) is None and not Path(f"/usr/sbin/{exe}").exists()]


def install_packages(log=print) -> None:
    """apt-get install the missing packages (needs root); daemons are kept from starting."""
    missing = missing_packages()
    if not missing:
        return
    if os.geteuid() != 0:
        raise ClusterError(f"SLURM packages {missing} are missing and installing them needs root "
                           f"(apt-get install --no-install-recommends {' '.join(PACKAGES)})")
    policy = Path("/usr/sbin/policy-rc.d")
    ours = not policy.exists()
    if ours:  # "exit 101": invoke-rc.d must not start the system's own munge/slurm services
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        log(f"[slurm] apt-get install {' '.join(PACKAGES)}")
        for cmd in (["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if r.returncode:
                raise ClusterError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr[-2000:]}")
    finally:
        if ours:
            policy.unlink(missing_ok=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_line() -> str:
    """`slurmd -C`'s NodeName line (CPUs, sockets, memory) with NodeAddr pinned to localhost."""
    out = subprocess.run([DAEMONS["slurmd"], "-C"], capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("NodeName="))
    return f"{line} NodeAddr=127.0.0.1 State=UNKNOWN"


@dataclass
class LocalCluster:
    root: Path
    pids: dict[str, int] = field(default_factory=dict)
    cmdlines: dict[str, str] = field(default_factory=dict)
    _procs: dict = field(default_factory=dict, repr=False)  # Popen objects when started by this process

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """Environment for sbatch/squeue/scontrol/srun talking to this cluster."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    # ------------------------------------------------------------------ config
    def write_config(self) -> None:
        r = self.root
        for d in ("etc", "munge", "state", "spool", "log", "run"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o700)
        key = r / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        host = socket.gethostname().split(".")[0]
        self.conf.write_text("\n".join([
            CONF_HEADER,
            "ClusterName=fbtlocal",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r / 'munge' / 'munge.socket'},cred_expire=10",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=bf_interval=1,sched_interval=2",
            "DependencyParameters=kill_invalid_depend",
            "JobRequeue=1",
            "KillWait=5",
            "MinJobAge=3600",  # finished jobs stay visible to scontrol (no accounting database here)
            "InactiveLimit=0",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=60",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'run' / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            _node_line(),
            f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
            "",
        ]))

    def check_dir(self) -> None:
        """Refuse (:class:`ClusterDirError`) a DIR that is not new, empty or an earlier cluster's, or whose
        cluster still runs: called before :meth:`write_config` writes anything."""
        if earlier_output(self.root, markers=("etc", "pids.json"), patterns=ENTRIES, writer="local_cluster",
                          option="DIR"):
            check_own_files(self.root / "etc", {"slurm.conf": lambda f: f.read_text().startswith(CONF_HEADER)},
                            writer="local_cluster", option="DIR/etc", instead="another DIR")
            running = self.attach(self.root).running() if (self.root / "pids.json").is_file() else []
            if running:
                raise ClusterDirError(f"a cluster is running in {self.root} ({', '.join(running)}): stop it first "
                                      f"with python -m fbt_megatron.launch.local_cluster stop {self.root}")

    def running(self) -> list[str]:
        """The recorded daemons still running as the same program."""
        return [name for name, pid in self.pids.items() if _cmdline(pid) and _cmdline(pid) == self.cmdlines.get(name)]

    # ------------------------------------------------------------------ daemons
    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")
        proc = subprocess.Popen(["setsid", DAEMONS[name], *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=self.env)
        # setsid execs the daemon in place when we are not a group leader: the PID is the daemon's.
        self.pids[name] = proc.pid
        self._procs[name] = proc
        time.sleep(0.3)
        cmd = _cmdline(proc.pid)
        if proc.poll() is not None or DAEMONS[name] not in cmd:
            raise ClusterError(f"{name} did not start (exit {proc.poll()}); see {self.root / 'log' / (name + '.out')}:\n"
                               + _tail(self.root / "log" / f"{name}.out"))
        self.cmdlines[name] = cmd
        self._save()

    def start(self, timeout: float = 60.0) -> "LocalCluster":
        install_packages()
        self.write_config()
        m = self.root / "munge"
        self._spawn("munged", ["-F", "--force", f"--socket={m / 'munge.socket'}", f"--key-file={m / 'munge.key'}",
                               f"--pid-file={m / 'munged.pid'}", f"--log-file={self.root / 'log' / 'munged.log'}",
                               f"--seed-file={m / 'munged.seed'}"])
        _wait(lambda: (m / "munge.socket").exists(), 10, "munged's socket")
        self._spawn("slurmctld", ["-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", ["-D", "-f", str(self.conf)])
        deadline = time.time() + timeout
        while time.time() < deadline:
            for name, pid in self.pids.items():
                if not _alive(pid):
                    raise ClusterError(f"{name} exited during start-up:\n" + _tail(self.root / "log" / f"{name}.out")
                                       + _tail(self.root / "log" / f"{name}.log"))
            state = self.run(["sinfo", "-h", "-o", "%t"], check=False).stdout.strip()
            if state.startswith("idle"):
                break
            time.sleep(0.5)
        else:
            raise ClusterError(f"the node did not become idle within {timeout:.0f}s (sinfo: {state!r}); "
                               f"logs in {self.root / 'log'}")
        r = self.run(["srun", "-n1", "-t", "1", "true"], check=False, timeout=60)
        if r.returncode:
            raise ClusterError(f"srun -n1 true failed: {r.stderr}")
        return self

    def run(self, cmd: list[str], check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout, **kw)
        if check and r.returncode:
            raise ClusterError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
        return r

    def stop(self) -> None:
        """Cancel all jobs, then stop the daemons this object started (by PID, checked)."""
        if self.pids.get("slurmctld") and _alive(self.pids["slurmctld"]):
            self.run(["scancel", "--full", "-u", "root"], check=False)
            _wait(lambda: not self.run(["squeue", "-h"], check=False).stdout.strip(), 20, "jobs to end",
                  raise_=False)
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.pids.get(name)
            if pid and _cmdline(pid) == self.cmdlines.get(name):
                os.kill(pid, signal.SIGTERM)
                if not _wait(lambda: _cmdline(pid) != self.cmdlines[name], 15, name, raise_=False):
                    os.kill(pid, signal.SIGKILL)
            proc = self._procs.pop(name, None)
            if proc is not None:  # reap our child (no zombie left behind)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    pass
            self.pids.pop(name, None)
        if (self.root / "pids.json").exists():  # a start that failed before its first daemon wrote none
            self._save()

    # ------------------------------------------------------------------ persistence (start/stop from a shell)
    def _save(self) -> None:
        (self.root / "pids.json").write_text(json.dumps({"pids": self.pids, "cmdlines": self.cmdlines}))

    @classmethod
    def attach(cls, root: Path) -> "LocalCluster":
        """The cluster that ``start`` recorded in ``root/pids.json``; one sentence when there is none."""
        try:
            data = json.loads((Path(root) / "pids.json").read_text())
            return cls(Path(root), dict(data["pids"]), dict(data["cmdlines"]))
        except FileNotFoundError:
            raise ClusterDirError(f"{root} holds no local cluster (no pids.json): nothing to stop") from None
        except (OSError, ValueError, KeyError, TypeError):
            raise ClusterDirError(f"{root / 'pids.json'} is not a record local_cluster wrote: nothing was "
                                  "changed") from None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _wait(cond, timeout: float, what: str, raise_: bool = True) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    if raise_:
        raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}")
    return False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print(__doc__.strip().splitlines()[0] + "\nusage: python -m fbt_megatron.launch.local_cluster start|stop DIR")
        return 2
    root = Path(argv[1]).resolve()
    try:
        if argv[0] == "start":
            cluster = LocalCluster(root)
            cluster.check_dir()  # before anything is written (the stop below writes pids.json)
            try:
                cluster.start()
            except BaseException:
                cluster.stop()
                raise
            print(f"export SLURM_CONF={cluster.conf}")
        else:
            LocalCluster.attach(root).stop()
    except UserError as e:
        return report("local_cluster", e)
    except ClusterError as e:  # the daemons or their packages: the message holds the log's tail
        print(f"local_cluster: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
