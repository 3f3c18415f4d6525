"""Render the batch-script template (``fbt_megatron/launch/train.sbatch``, package data; ``slurm/train.sbatch``
in the repository links to it) for a recipe and submit it (``fbt slurm submit``).

The recipe is resolved into its run plan for the job's process count and nodes (what ``fbt train
--dry-run`` prints; fbt_megatron/resolve) before anything is written or submitted. Every
submission appends to ``RUN_DIR/slurm/jobs.jsonl`` (what ``fbt slurm status`` reads) and keeps the
rendered script next to it; logs go to ``RUN_DIR/slurm/logs/<job-name>-<jobid>.out``.

``--phases`` submits the recipe as two chained jobs on the same run directory: phase 1 trains the
single-pass part (``train.stop_at_step = schedule.feedback_start_step``), phase 2 waits for it with
``--dependency=afterok`` and resumes from its checkpoint into the feedback mix. Each phase can then
get its own time limit and node count, and a failed phase 1 never starts phase 2.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fbt_megatron.errors import UserError

DEFAULT_TEMPLATE = Path(__file__).with_name("train.sbatch")  # shipped in the wheel (package data)


class SubmitError(UserError, RuntimeError):
    pass


# squeue's states of a job that is not over
ACTIVE = "PENDING,RUNNING,CONFIGURING,COMPLETING,SUSPENDED,REQUEUED,REQUEUE_HOLD,RESIZING,SIGNALING,STAGE_OUT"


def active_jobs(job_ids: list[str]) -> list[str]:
    """Those of ``job_ids`` (and their array tasks) that squeue still lists, as 'id state' (none where there
    is no squeue: sbatch then says what is missing)."""
    if not job_ids or shutil.which("squeue") is None:
        return []
    r = subprocess.run(["squeue", "-h", f"--jobs={','.join(job_ids)}", f"--states={ACTIVE}", "-o", "%i %T"],
                       capture_output=True, text=True)
    if r.returncode and "Invalid job id" not in r.stderr:
        raise SubmitError(f"squeue failed ({r.returncode}): {r.stderr.strip()}")
    return [line.strip() for line in r.stdout.splitlines() if line.strip()]


@dataclass
class JobSpec:
    recipe: str
    overrides: list[str] = field(default_factory=list)
    nodes: int = 1
    min_nodes: int | None = None  # elastic: torchrun --nnodes MIN:MAX
    gpus_per_node: int = 8  # processes per node (one per GPU; CPU processes with cpu=True)
    cpus_per_task: int | None = None
    time: str = "24:00:00"
    signal_seconds: int = 300  # USR1 this long before the time limit (time to finish a step and save)
    max_restarts: int = 3
    cpu: bool = False  # CPU-only cluster / tests: no GPU request, gloo
    partition: str | None = None
    account: str | None = None
    dependency: str | None = None
    job_name: str | None = None
    sbatch_args: list[str] = field(default_factory=list)
    python: str = sys.executable
    train_module: str = "fbt_megatron.cli"  # torchrun -m MODULE train ...
    template: Path = DEFAULT_TEMPLATE
    workdir: Path = field(default_factory=Path.cwd)


GPU_ENV = [
    # one CUDA work queue per device: Megatron's TP/SP communication overlap relies on kernels running in
    # the order they were issued
    "export CUDA_DEVICE_MAX_CONNECTIONS=1",
    # the 1/2/3-pass batches allocate different activation sizes: expandable segments keep them from
    # fragmenting the cache (kept if the cluster's environment already sets it)
    'export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"',
]


def _q(x) -> str:
    return shlex.quote(str(x))


def render(spec: JobSpec, run_dir: Path, job_name: str) -> str:
    if not spec.template.is_file():
        raise SubmitError(f"sbatch template {spec.template} not found (--template PATH)")
    elastic = bool(spec.min_nodes) and spec.min_nodes != spec.nodes
    if spec.min_nodes is not None and not 1 <= spec.min_nodes <= spec.nodes:
        raise SubmitError(f"--min-nodes {spec.min_nodes} must lie in [1, --nodes {spec.nodes}]")
    # Elastic: the scheduler may start the job on any node count in [MIN, MAX] (sbatch --nodes=MIN-MAX),
    # torchrun's rendezvous accepts that many agents (--nnodes MIN:MAX).
    nnodes = f"{spec.min_nodes}:{spec.nodes}" if elastic else str(spec.nodes)
    cpus = spec.cpus_per_task or ((os.cpu_count() or 1) if spec.cpu else 8 * spec.gpus_per_node)
    torchrun = [spec.python, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
                f"--nproc-per-node={spec.gpus_per_node}", "--rdzv-backend=c10d",
                f"--max-restarts={spec.max_restarts}", "-m", spec.train_module, "train", spec.recipe,
                *spec.overrides, f"run_dir={run_dir}"]
    # Node-side command: torchrun ignores USR1 (its default action would kill it); the trainers
    # install their own handler. $FBT_RDZV_* and $SLURM_JOB_ID expand on each node.
    node = ('trap "" USR1; exec ' + " ".join(_q(a) for a in torchrun[:3])
            + ' --rdzv-endpoint="$FBT_RDZV_HOST:$FBT_RDZV_PORT" --rdzv-id="$SLURM_JOB_ID" '
            + " ".join(_q(a) for a in torchrun[3:]))
    health = [spec.python, "-m", "fbt_megatron.launch.health", "--run-dir", str(run_dir),
              "--gpus", "0" if spec.cpu else str(spec.gpus_per_node)]
    # GPU nodes whole (--exclusive, --mem=0: all of each node's memory; a shared node's other jobs would
    # take GPU memory and host memory for pinned buffers)
    extra = [f"#SBATCH --gpus-per-node={spec.gpus_per_node}", "#SBATCH --exclusive", "#SBATCH --mem=0"] \
        if not spec.cpu else []
    for flag, value in (("partition", spec.partition), ("account", spec.account), ("dependency", spec.dependency)):
        if value:
            extra.append(f"#SBATCH --{flag}={value}")
    extra += [f"#SBATCH {a}" for a in spec.sbatch_args]
    env = ["export FBT_DEVICE=cpu DS_ACCELERATOR=cpu"] if spec.cpu else GPU_ENV
    fields = {
        "job_name": job_name, "nodes": f"{spec.min_nodes}-{spec.nodes}" if elastic else spec.nodes,
        "cpus_per_task": cpus, "time": spec.time,
        "signal_seconds": spec.signal_seconds, "log_dir": run_dir / "slurm" / "logs",
        "sbatch_extra": "\n".join(extra), "workdir": _q(spec.workdir), "run_dir": _q(run_dir),
        "omp_threads": max(1, cpus // spec.gpus_per_node), "env_extra": "\n".join(env),
        "health_cmd": " ".join(_q(a) for a in health), "node_cmd": _q(node), "python": _q(spec.python),
    }
    text = spec.template.read_text()
    for key, value in fields.items():
        text = text.replace("{{" + key + "}}", str(value))
    left = sorted(set(re.findall(r"{{(\w+)}}", text)))
    if left:
        raise SubmitError(f"template {spec.template} has fields nobody fills: {left}")
    return text


# sbatch --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (SLURM's sbatch(1)); UNLIMITED or INFINITE
_TIME = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|(?i:unlimited|infinite)")


def check_time(value: str) -> str:
    """``value`` if sbatch accepts it as ``--time``; else :class:`SubmitError` naming the formats it takes."""
    if not _TIME.fullmatch(str(value)):
        raise SubmitError(f"--time {value!r} is not a SLURM time limit: use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM "
                          "or D-HH:MM:SS (e.g. 25:00:00 or 1-01:00:00), or UNLIMITED")
    return value


def resolve_job(spec: JobSpec, overrides: list[str]):
    """The run plan ``fbt train --dry-run`` prints for this job (its recipe, its nodes' device and each
    process count it may start with), so a job that would fail at start-up is never queued; raises
    :class:`SubmitError` with the dry run's message."""
    from fbt_megatron.recipe import RecipeError, load_recipe
    from fbt_megatron.resolve.plan import Environment
    from fbt_megatron.resolve.resolver import resolve_run

    try:
        recipe = load_recipe(spec.recipe, overrides)
        return [resolve_run(recipe, nodes * spec.gpus_per_node, Environment.nodes(gpu=not spec.cpu))
                for nodes in sorted({spec.min_nodes or spec.nodes, spec.nodes})][-1]
    except (RecipeError, FileNotFoundError) as e:
        raise SubmitError(f"{spec.recipe}: {e}") from None


def new_script_path(folder: Path, name: str) -> Path:
    """``folder/NAME.YYYYmmdd-HHMMSS.sbatch``, with ``-2``, ``-3``... when a submit in the same second took it:
    a script a job record names is never replaced."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return next(p for i in itertools.count(1)
                if not (p := folder / f"{name}.{stamp}{f'-{i}' if i > 1 else ''}.sbatch").exists())


def sbatch(path: Path, script: str, dirs: tuple[Path, ...] = ()) -> str:
    """Write ``script`` to ``path`` (a new file; its folder and ``dirs``, e.g. the log folder, are created)
    and submit it; returns the job id. When sbatch refuses it, is missing, or the script cannot be written,
    what this call created is removed again (the script, and each folder it made that is still empty:
    nothing that was there before) and :class:`SubmitError` says why."""
    made: list[Path] = []
    wrote = False
    try:
        for folder in (path.parent, *dirs):  # each folder made, outermost first
            for d in (*reversed(folder.parents), folder):
                if not d.is_dir():
                    try:
                        d.mkdir()
                    except FileExistsError:  # made meanwhile by another process (or a file: the next level says so)
                        continue
                    made.append(d)
        with open(path, "x") as f:
            wrote = True
            f.write(script)
        r = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
        if not r.returncode:
            return r.stdout.strip().split(";")[0]
        said = "; ".join(line.strip() for line in r.stderr.splitlines() if line.strip())  # one line
        refused = f"sbatch refused the job: {said or f'exit status {r.returncode}'}"
    except FileExistsError:
        refused = f"{path} was written meanwhile by another submit: submit again"
    except OSError as e:
        if e.filename == "sbatch":
            refused = "sbatch is not installed here: submit from a SLURM login node"
        elif e.filename is not None:
            refused = f"cannot write {e.filename}: {e.strerror}"
        else:
            raise
    if wrote:
        path.unlink(missing_ok=True)
    for d in reversed(made):  # deepest first; a folder something else wrote into meanwhile stays
        try:
            d.rmdir()
        except OSError:
            pass
    raise SubmitError(refused)


def submit(spec: JobSpec, *, phases: bool = False, dry_run: bool = False, print_fn=print) -> list[dict]:
    """Resolve the run plan, render, keep and (unless dry_run) sbatch the job(s); returns one record per job."""
    from fbt_megatron.resolve.plan import nothing_to_train
    from fbt_megatron.train.callbacks.metrics_file import read_rows

    check_time(spec.time)
    first = resolve_job(spec, spec.overrides)
    recipe = first.recipe
    run_dir = recipe.resolved_run_dir()
    run_dir = run_dir if run_dir.is_absolute() else (spec.workdir / run_dir)
    base = spec.job_name or recipe.name
    plan = [(None, spec.overrides)]
    if phases:
        start = recipe.schedule.feedback_start_step
        if not 0 < start < recipe.train.steps:
            raise SubmitError(f"--phases needs 0 < schedule.feedback_start_step < train.steps "
                              f"(got {start} of {recipe.train.steps})")
        plan = [(1, [*spec.overrides, f"train.stop_at_step={start}"]), (2, spec.overrides)]
    out_dir = run_dir / "slurm"
    if not dry_run and spec.dependency is None:  # a second job on the run would be refused at start-up
        busy = active_jobs([row["job_id"] for row in read_rows(out_dir / "jobs.jsonl")])
        if busy:
            raise SubmitError(f"{run_dir} has jobs queued or running ({', '.join(busy)}): wait for them or scancel "
                              f"them, or pass --dependency afterany:{busy[-1].split()[0]} to continue after them")
    # every job's plan before the first sbatch: a job that would train nothing is not queued (a first phase
    # already done is left out, its second submitted alone); if none would train, nothing is submitted
    idle, resumed = {}, 0
    for phase, overrides in plan:
        job_plan = first if overrides is spec.overrides else resolve_job(
            JobSpec(**{**spec.__dict__, "overrides": overrides}), overrides)
        if job_plan.resume.checkpoint is not None:
            idle[phase] = nothing_to_train(job_plan.run_dir, job_plan.resume.step, job_plan.recipe.train)
            resumed = job_plan.resume.step
    if all(idle.get(phase) for phase, _ in plan):
        raise SubmitError(f"{spec.recipe}: {idle[plan[-1][0]]}; nothing was submitted")
    if idle.get(1):
        print_fn(f"phase 1 is done: {run_dir} is at step {resumed}, at or past the feedback switch at step "
                 f"{recipe.schedule.feedback_start_step}; submitting phase 2 alone")
    plan = [(phase, overrides) for phase, overrides in plan if not idle.get(phase)]
    records, previous = [], None
    for phase, overrides in plan:
        name = base if phase is None else f"{base}-p{phase}"
        dependency = spec.dependency if previous is None else f"afterok:{previous}"
        this = JobSpec(**{**spec.__dict__, "overrides": overrides, "dependency": dependency})
        script = render(this, run_dir, name)
        rec = {"phase": phase, "job_name": name, "nodes": spec.nodes, "gpus_per_node": spec.gpus_per_node,
               "dependency": dependency, "submitted_at": time.time()}
        if dry_run:
            print_fn(script)
            rec["job_id"] = previous = f"<phase{phase or 1}>"
            records.append(rec)
            continue
        path = new_script_path(out_dir, name)
        try:
            job_id = sbatch(path, script, dirs=(out_dir / "logs",))
        except SubmitError as e:
            if previous is None:
                raise SubmitError(f"{e}; nothing was queued, and the script and folders this submit made were "
                                  "removed") from None
            raise SubmitError(f"{e}; phase 1 is queued as job {previous}: scancel it and submit again, or submit "
                              f"the recipe without --phases with --dependency afterok:{previous}") from None
        rec.update(job_id=job_id, script=str(path), log=str(out_dir / "logs" / f"{name}-{job_id}.out"))
        with open(out_dir / "jobs.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        print_fn(f"submitted {name}: job {job_id}" + (f" (after {previous})" if dependency else "")
                 + f"; script {path}; log {rec['log']}")
        records.append(rec)
        previous = job_id
    return records
