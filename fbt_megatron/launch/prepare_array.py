"""``fbt slurm submit-prepare``: ``fbt data prepare`` across nodes as SLURM job arrays.

Three submissions, chained with ``--dependency=afterok`` (data_pipeline/array.py describes the stages):
a **count** array and a **tokenize** array of N tasks each (``sbatch --array=0-(N-1)``; task i reads
``SLURM_ARRAY_TASK_ID``), then one **merge** job. Scripts, ``jobs.jsonl`` and the logs
(``logs/<name>-<stage>-<array job>_<task>.out``) are kept in ``<out>.array/``.

Running the same command again resumes: the plan is kept when nothing changed, finished slices exit at
once, a tokenize task killed part-way keeps its finished shards, and the merge runs last. It refuses
while jobs of an earlier submission are still queued or running (two tasks must not write one slice).
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fbt_megatron.launch.submit import SubmitError, active_jobs, check_time, new_script_path, sbatch

STAGES = ("count", "tokenize", "merge")


@dataclass
class PrepareSpec:
    inputs: list[str]
    out: str
    tokenizer: str
    tasks: int
    name: str | None = None
    shard_mb: float = 16.0
    text_field: str = "text"
    id_field: str | None = "id"
    skip_bad_rows: bool = False
    bos: str = "no"  # fbt data prepare --bos
    overwrite: bool = False  # fbt data prepare --overwrite: replace another dataset at out
    workers: int = 1  # tokenizer processes per tokenize task
    cpus_per_task: int | None = None  # default: workers
    time: str = "24:00:00"
    partition: str | None = None
    account: str | None = None
    sbatch_args: list[str] = field(default_factory=list)
    python: str = sys.executable
    module: str = "fbt_megatron.cli"  # each stage runs `python -m MODULE data prepare-task ...`
    workdir: Path = field(default_factory=Path.cwd)


def _q(x) -> str:
    return shlex.quote(str(x))


def render(spec: PrepareSpec, adir: Path, stage: str, name: str, dependency: str | None) -> str:
    """The batch script of one stage (an array of ``spec.tasks`` tasks for count and tokenize)."""
    is_array = stage != "merge"
    cpus = spec.cpus_per_task or (spec.workers if stage == "tokenize" else 1)
    lines = ["#!/bin/bash",
             f"# fbt data prepare across nodes, stage {stage} (rendered by `fbt slurm submit-prepare`; "
             "data_pipeline/array.py)",
             f"#SBATCH --job-name={name}-{stage}",
             "#SBATCH --ntasks=1",
             f"#SBATCH --cpus-per-task={cpus}",
             f"#SBATCH --time={spec.time}",
             "#SBATCH --requeue",  # a task on a failed node runs again and resumes its slice
             "#SBATCH --open-mode=append",
             f"#SBATCH --output={adir / 'logs'}/%x-" + ("%A_%a.out" if is_array else "%j.out")]
    if is_array:
        lines.append(f"#SBATCH --array=0-{spec.tasks - 1}")
    for flag, value in (("partition", spec.partition), ("account", spec.account), ("dependency", dependency)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    lines += [f"#SBATCH {a}" for a in spec.sbatch_args]
    cmd = [spec.python, "-m", spec.module, "data", "prepare-task", stage, "--plan", str(adir)]
    if stage == "tokenize":
        cmd += ["--workers", str(spec.workers)]
    lines += ["set -euo pipefail",
              f"cd {_q(spec.workdir)}",
              "export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1",
              'echo "[fbt] prepare ' + stage + ' job ${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID} task '
              '${SLURM_ARRAY_TASK_ID:--} (restart ${SLURM_RESTART_COUNT:-0}) on $(hostname), $(date -u +%FT%TZ)"',
              "exec " + " ".join(_q(a) for a in cmd), ""]
    return "\n".join(lines)


def submit_prepare(spec: PrepareSpec, *, dry_run: bool = False, print_fn=print) -> list[dict]:
    """Plan (or keep the plan), then sbatch the three stages; returns one record per submitted job
    (none when the plan is merged already)."""
    from data_pipeline import array
    from data_pipeline.errors import DataError
    from fbt_megatron.train.callbacks.metrics_file import read_rows

    if spec.tasks < 1 or spec.workers < 1:
        raise SubmitError(f"--array {spec.tasks} and --workers {spec.workers} must be at least 1")
    check_time(spec.time)  # before the plan is written: sbatch would refuse it only after
    # before the plan is touched: a new plan removes the work of the old one, which its jobs may be writing
    jobs_file = array.array_dir(Path(spec.out).resolve()) / "jobs.jsonl"
    busy = active_jobs([row["job_id"] for row in read_rows(jobs_file)]) if not dry_run else []
    if busy:
        raise SubmitError(f"jobs of an earlier submission are still queued or running ({', '.join(busy)}): wait for "
                          f"them or scancel them, then submit again")
    try:
        adir, plan, state = array.write_plan(spec.inputs, spec.out, spec.tokenizer, spec.tasks, name=spec.name,
                                             shard_bytes=int(spec.shard_mb * (1 << 20)), text_field=spec.text_field,
                                             id_field=spec.id_field, skip_bad_rows=spec.skip_bad_rows, bos=spec.bos,
                                             write=not dry_run, overwrite=spec.overwrite)
    except DataError as e:
        raise SubmitError(str(e)) from None
    if state == "merged":
        print_fn(f"{plan['out']} is prepared already from the same inputs and settings ({adir / array.MERGED_FILE}); "
                 "nothing submitted")
        return []
    empty = sum(1 for s in plan["slices"] if not s)
    said = {"new": "new, not written: a dry run", "resume": "resume"}[state] if dry_run else state
    print_fn(f"plan {adir / array.PLAN_FILE} ({said}): {len(plan['units'])} units in {spec.tasks} slices"
             + (f" ({empty} empty: more tasks than the input's units can use)" if empty else ""))
    name = spec.name or Path(plan["out"]).name
    records, previous = [], None
    for stage in STAGES:
        dependency = f"afterok:{previous}" if previous else None
        script = render(spec, adir, stage, name, dependency)
        rec = {"stage": stage, "job_name": f"{name}-{stage}", "tasks": spec.tasks if stage != "merge" else 1,
               "dependency": dependency, "plan": plan["id"], "submitted_at": time.time()}
        if dry_run:
            print_fn(script)
            rec["job_id"] = previous = f"<{stage}>"
            records.append(rec)
            continue
        path = new_script_path(adir, f"{name}-{stage}")
        try:  # refused: its script and new log folder removed
            job_id = sbatch(path, script, dirs=(adir / "logs",))
        except SubmitError as e:
            if previous is None:
                raise
            queued = ", ".join(f"{r['stage']} as job {r['job_id']}" for r in records)
            raise SubmitError(f"{e}; {queued} queued: scancel {' '.join(r['job_id'] for r in records)} and submit "
                              "again") from None
        rec.update(job_id=job_id, script=str(path))
        with open(jobs_file, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print_fn(f"submitted {name}-{stage}: job {job_id}" + (f" (array 0-{spec.tasks - 1})" if stage != "merge" else "")
                 + (f" after {previous}" if previous else "") + f"; script {path}")
        records.append(rec)
        previous = job_id
    return records
