"""``fbt slurm status RUN_DIR``: the run's jobs (from RUN_DIR/slurm/jobs.jsonl and the scheduler),
its step, tokens and restarts (RUN_DIR/metrics.jsonl) and its last checkpoint.

``python -m fbt_megatron.launch.status --was-preempted RUN_DIR`` exits 0 when the last invocation
stopped for a preemption signal (the batch script requeues only then, not after a finished run).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from fbt_megatron.train.callbacks.metrics_file import read_rows


def _sacct_states(ids: list[str]) -> dict[str, str]:
    """Finished jobs from the accounting database (``sacct``, one line per job allocation; its most
    recent run for a requeued job). Empty where sacct is missing or accounting is disabled."""
    if not ids or shutil.which("sacct") is None:
        return {}
    r = subprocess.run(["sacct", "--noheader", "--parsable2", "--allocations", "--jobs", ",".join(ids),
                        "--format", "JobIDRaw,State,ExitCode,Elapsed,End"],
                       capture_output=True, text=True, timeout=30)
    if r.returncode:  # e.g. "Slurm accounting storage is disabled"
        return {}
    states = {}
    for line in r.stdout.splitlines():
        parts = line.split("|")
        if len(parts) == 5 and parts[0] in ids:
            jid, state, exit_code, elapsed, end = parts
            states[jid] = f"{state} (exit {exit_code}, elapsed {elapsed}, ended {end}; sacct)"
    return states


def job_states(job_ids: list[str]) -> dict[str, str]:
    """State per job id: squeue for queued/running jobs; for finished ones sacct where accounting is
    enabled (it keeps them), else scontrol (which forgets them after MinJobAge, 300 s by default)."""
    states: dict[str, str] = {}
    ids = [j for j in job_ids if j.isdigit()]
    if not ids:
        return states
    try:
        r = subprocess.run(["squeue", "-h", "-j", ",".join(ids), "-o", "%i|%T|%M|%l|%R"],
                           capture_output=True, text=True, timeout=30)
        for line in r.stdout.splitlines():
            jid, state, used, limit, reason = line.split("|")
            states[jid] = f"{state} (elapsed {used} of {limit}; {reason})"
        states.update(_sacct_states([j for j in ids if j not in states]))
        for jid in ids:
            if jid in states:
                continue
            r = subprocess.run(["scontrol", "-o", "show", "job", jid], capture_output=True, text=True, timeout=30)
            fields = dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)
            states[jid] = (f"{fields['JobState']} (exit {fields.get('ExitCode', '?')}, restarts "
                           f"{fields.get('Restarts', '0')})" if "JobState" in fields else
                           "gone from the scheduler (finished; no accounting database to ask: sacct)")
    except (OSError, subprocess.TimeoutExpired) as e:
        for jid in ids:
            states.setdefault(jid, f"unknown ({e})")
    return states


def status(run_dir: Path) -> dict:
    run_dir = Path(run_dir)
    jobs = read_rows(run_dir / "slurm" / "jobs.jsonl")
    states = job_states([str(j["job_id"]) for j in jobs])
    rows = read_rows(run_dir / "metrics.jsonl")
    metrics = [r for r in rows if "event" not in r]  # step rows (validation lines have "event")
    validations = [r for r in rows if r.get("event") == "metrics" and any(k.startswith("val/") for k in r)]
    pointer = run_dir / "checkpoints" / "latest"
    latest = pointer.read_text().strip() if pointer.is_file() else None
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    last = metrics[-1] if metrics else {}
    return {
        "run_dir": str(run_dir),
        "jobs": [dict(j, state=states.get(str(j["job_id"]), "?")) for j in jobs],
        "step": last.get("step"), "total_steps": summary.get("total_steps"),
        "tokens_seen": last.get("tokens_seen"), "consumed_sequences": last.get("consumed_sequences"),
        "last_loss": last.get("loss"), "last_step_at": last.get("time"),
        "restarts": sorted({(m.get("slurm_job"), m.get("slurm_restart", "0"), m.get("elastic_restart", "0"))
                            for m in metrics if m.get("slurm_job")}),
        "latest_checkpoint": latest, "stop_reason": summary.get("stop_reason"),
        "last_validation": validations[-1] if validations else None,
    }


def format_status(s: dict) -> str:
    lines = [f"run {s['run_dir']}"]
    for j in s["jobs"]:
        phase = f" phase {j['phase']}" if j.get("phase") else ""
        lines.append(f"  job {j['job_id']} {j['job_name']}{phase}: {j['state']}  log {j.get('log', '-')}")
    if not s["jobs"]:
        lines.append("  no jobs submitted from here (RUN_DIR/slurm/jobs.jsonl)")
    if s["step"] is not None:
        ago = f", {time.time() - s['last_step_at']:.0f}s ago" if s.get("last_step_at") else ""
        lines.append(f"  step {s['step']}/{s['total_steps'] or '?'}  tokens {s['tokens_seen']:,}  "
                     f"loss {s['last_loss']:.4f}{ago}")
    else:
        lines.append("  no steps logged yet")
    if s.get("last_validation"):
        v = s["last_validation"]
        body = " ".join(f"{k.split('_k')[-1]}-pass {x:.4f}" for k, x in sorted(v.items()) if k.startswith("val/loss_k"))
        lines.append(f"  validation @ step {v['step']}: {body}")
    if len(s["restarts"]) > 1:
        lines.append("  (re)starts: " + ", ".join(f"job {j} requeue {r} elastic {e}" for j, r, e in s["restarts"]))
    lines.append(f"  latest checkpoint: {s['latest_checkpoint'] or 'none'}")
    if s.get("stop_reason"):
        lines.append(f"  last stop: {s['stop_reason']}")
    return "\n".join(lines)


def was_preempted(run_dir: Path) -> bool:
    path = Path(run_dir) / "summary.json"
    return path.is_file() and bool(json.loads(path.read_text()).get("preempted"))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 2 and argv[0] == "--was-preempted":
        return 0 if was_preempted(Path(argv[1])) else 1
    print("usage: python -m fbt_megatron.launch.status --was-preempted RUN_DIR", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
