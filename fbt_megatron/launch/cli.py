"""``fbt slurm submit|status|submit-prepare``: launch recipes on a SLURM cluster and follow them; prepare
data across nodes.

    fbt slurm submit RECIPE.yaml --nodes N --gpus-per-node G [--time HH:MM:SS] [--phases]
                     [--min-nodes M] [--max-restarts R] [--signal-seconds S] [--partition P]
                     [--account A] [--dependency D] [--sbatch-arg=--qos=high] [--cpu] [--dry-run]
                     [dotted.key=value ...]
    fbt slurm status RUN_DIR
    fbt slurm submit-prepare --array N --input PATH... --tokenizer TOK --out DIR [--workers W]
                     [--shard-mb MB] [--text-field F] [--id-field F] [--skip-bad-rows] [--bos no|yes|auto]
                     [--name NAME] [--time HH:MM:SS] [--partition P] [--account A] [--sbatch-arg=...]
                     [--dry-run]

``submit`` resolves the recipe's run plan for N x G processes (``fbt train --dry-run``'s checks:
a job that would fail at start-up is never queued), renders the batch-script template
(``fbt_megatron/launch/train.sbatch``, shipped with the package; one task per node -> srun ->
torchrun with c10d rendezvous on the first node), keeps the rendered script and the
job ids in RUN_DIR/slurm/ and submits it (``--dry-run`` prints the plan and the script instead). ``--phases``
submits single-pass pre-training and the feedback phase as two jobs chained with afterok.
``status`` shows the jobs' states, the step, tokens and restarts, and the latest checkpoint.
``submit-prepare`` runs ``fbt data prepare`` as SLURM job arrays: N tasks tokenize a slice each, a last
job merges; the same command again resumes (``launch/prepare_array.py``, docs/data.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data_pipeline.argtypes import number, positive_int
from fbt_megatron.launch.submit import JobSpec, SubmitError, check_time, resolve_job, submit


def _submit_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fbt slurm submit", description="Render and submit a training job.")
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value recipe overrides")
    ap.add_argument("--nodes", type=positive_int, default=1)
    ap.add_argument("--min-nodes", type=positive_int, default=None, help="elastic: start on MIN..NODES nodes (sbatch --nodes=MIN-NODES, torchrun --nnodes MIN:NODES); "
                    "a node lost mid-job still ends the job (docs/slurm.md)")
    ap.add_argument("--gpus-per-node", type=positive_int, default=8, help="processes per node (one per GPU)")
    ap.add_argument("--cpus-per-task", type=positive_int, default=None)
    ap.add_argument("--time", default="24:00:00", help="time limit per job (a preempted job requeues)")
    ap.add_argument("--signal-seconds", type=positive_int, default=300, help="USR1 this long before the limit")
    ap.add_argument("--max-restarts", type=number(int, ge=0), default=3, help="torchrun restarts after a worker failure")
    ap.add_argument("--phases", action="store_true", help="single-pass phase and feedback phase as 2 chained jobs")
    ap.add_argument("--partition")
    ap.add_argument("--account")
    ap.add_argument("--dependency")
    ap.add_argument("--job-name")
    ap.add_argument("--sbatch-arg", action="append", default=[], help="extra #SBATCH line, e.g. --sbatch-arg=--qos=high")
    ap.add_argument("--cpu", action="store_true", help="CPU processes (no GPU request; gloo)")
    ap.add_argument("--template", type=Path, default=None)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--train-module", default="fbt_megatron.cli", help="module torchrun runs as `-m MODULE train`")
    ap.add_argument("--dry-run", action="store_true", help="print the batch script, submit nothing")
    return ap


def _prepare_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fbt slurm submit-prepare",
                                 description="`fbt data prepare` as SLURM job arrays: count, tokenize (N tasks), merge.")
    ap.add_argument("--array", type=positive_int, required=True, metavar="N", help="array tasks: slices of the input")
    ap.add_argument("--input", nargs="+", required=True, help="as `fbt data prepare --input`")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True, help="the dataset directory (work and logs in OUT.array/)")
    ap.add_argument("--name")
    ap.add_argument("--shard-mb", type=number(float, gt=0), default=16.0)
    ap.add_argument("--text-field", default="text")
    ap.add_argument("--id-field", default="id")
    ap.add_argument("--skip-bad-rows", action="store_true")
    ap.add_argument("--bos", choices=("no", "yes", "auto"), default="no", help="as `fbt data prepare --bos`")
    ap.add_argument("--overwrite", action="store_true", help="as `fbt data prepare --overwrite`")
    ap.add_argument("--workers", type=positive_int, default=1, help="tokenizer processes per tokenize task")
    ap.add_argument("--cpus-per-task", type=positive_int, default=None, help="default: --workers (tokenize), 1 (count, merge)")
    ap.add_argument("--time", default="24:00:00", help="time limit of each task")
    ap.add_argument("--partition")
    ap.add_argument("--account")
    ap.add_argument("--sbatch-arg", action="append", default=[], help="extra #SBATCH line, e.g. --sbatch-arg=--qos=high")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--module", default="fbt_megatron.cli", help="module each stage runs as `-m MODULE data prepare-task`")
    ap.add_argument("--dry-run", action="store_true", help="print the plan's summary and the batch scripts; write and submit nothing")
    return ap


def _submit_prepare(argv: list[str]) -> int:
    from fbt_megatron.launch.prepare_array import PrepareSpec, submit_prepare

    a = _prepare_parser().parse_args(argv)
    spec = PrepareSpec(inputs=a.input, out=a.out, tokenizer=a.tokenizer, tasks=a.array, name=a.name,
                       shard_mb=a.shard_mb, text_field=a.text_field, id_field=a.id_field or None,
                       skip_bad_rows=a.skip_bad_rows, bos=a.bos, overwrite=a.overwrite, workers=a.workers,
                       cpus_per_task=a.cpus_per_task,
                       time=a.time,
                       partition=a.partition, account=a.account, sbatch_args=a.sbatch_arg, python=a.python,
                       module=a.module)
    try:
        submit_prepare(spec, dry_run=a.dry_run)
    except SubmitError as e:
        print(f"fbt slurm submit-prepare: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] not in ("submit", "status", "submit-prepare"):
        print(f"fbt slurm: error: unknown command {argv[0]!r} (choose from submit, status, submit-prepare; "
              "fbt slurm --help)", file=sys.stderr)
        return 2
    if argv[0] == "submit-prepare":
        return _submit_prepare(argv[1:])
    if argv[0] == "status":
        from fbt_megatron.launch.status import format_status, status

        ap = argparse.ArgumentParser(prog="fbt slurm status",
                                     description="The run's jobs, step, tokens, restarts and latest checkpoint.")
        ap.add_argument("run_dir", type=Path)
        a = ap.parse_args(argv[1:])
        if not a.run_dir.is_dir():
            print(f"fbt slurm status: {a.run_dir} is not a directory", file=sys.stderr)
            return 2
        print(format_status(status(a.run_dir)))
        return 0
    a = _submit_parser().parse_intermixed_args(argv[1:])
    spec = JobSpec(recipe=a.recipe, overrides=a.overrides, nodes=a.nodes, min_nodes=a.min_nodes,
                   gpus_per_node=a.gpus_per_node, cpus_per_task=a.cpus_per_task, time=a.time,
                   signal_seconds=a.signal_seconds, max_restarts=a.max_restarts, cpu=a.cpu,
                   partition=a.partition, account=a.account, dependency=a.dependency, job_name=a.job_name,
                   sbatch_args=a.sbatch_arg, python=a.python, train_module=a.train_module)
    if a.template:
        spec.template = a.template
    try:
        check_time(a.time)  # before anything: sbatch would refuse it only after the script is written
        if a.dry_run:  # the run plan the job resolves to, as `fbt train --dry-run` prints it
            print(resolve_job(spec, a.overrides).to_yaml())
        submit(spec, phases=a.phases, dry_run=a.dry_run)
    except SubmitError as e:
        print(f"fbt slurm submit: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
