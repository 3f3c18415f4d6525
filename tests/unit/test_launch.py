"""`fbt slurm submit --dry-run` renders valid batch scripts for the big recipes; bad input is refused."""

import subprocess

import pytest

from fbt_megatron.launch.cli import main
from fbt_megatron.launch.submit import JobSpec, submit

# The big recipes' data (data/pretrain) lives on the cluster: the run plan checks the tokenizer and the
# sources at submit, so here they train on synthetic data.
CLUSTER_DATA = ["data.source=synthetic", "data.pipeline=null"]


@pytest.mark.parametrize("recipe,nodes", [("fbt-1b-400b", 8), ("fbt-3b", 16), ("fbt-7b", 32), ("fbt-13b", 64)])
def test_big_recipes_render_for_their_layout(recipe, nodes, tmp_path):
    out = []
    recs = submit(JobSpec(recipe=f"recipes/{recipe}.yaml", overrides=CLUSTER_DATA, nodes=nodes, gpus_per_node=8, workdir=tmp_path,
                          time="24:00:00"), phases=True, dry_run=True, print_fn=out.append)
    assert [r["phase"] for r in recs] == [1, 2]
    p1, p2 = out
    assert f"#SBATCH --nodes={nodes}" in p1 and "#SBATCH --gpus-per-node=8" in p1
    assert "#SBATCH --signal=B:USR1@300" in p1 and "#SBATCH --requeue" in p1
    assert "train.stop_at_step=" in p1 and "train.stop_at_step=" not in p2
    assert "#SBATCH --dependency=afterok:<phase1>" in p2
    assert '--rdzv-endpoint="$FBT_RDZV_HOST:$FBT_RDZV_PORT"' in p1 and "FBT_RDZV_PORT=$(( 20000 + SLURM_JOB_ID % 12000 ))" in p1
    assert "{{" not in p1
    # the rendered script is valid bash
    script = tmp_path / "job.sbatch"
    script.write_text(p1)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_submit_refuses_a_layout_that_does_not_divide(capsys):
    assert main(["submit", "recipes/tiny.yaml", "--nodes", "1", "--gpus-per-node", "3", "--cpu", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "batch.global_batch_size" in err or "parallel.tensor" in err
    assert main(["submit", "recipes/tiny.yaml", "--gpus-per-node", "1", "--cpu", "--dry-run", "model.hidden_size=130"]) == 2
    assert "model.hidden_size" in capsys.readouterr().err


def _srun_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.lstrip().startswith("srun ")]


def test_every_srun_asks_for_the_cpus_and_the_warning_is_caught_from_the_start(tmp_path):
    """srun does not inherit --cpus-per-task since Slurm 22.05: each srun line asks for the job's count.
    The USR1 trap and the preemption file are in place before the first srun (an early warning is kept)."""
    out = []
    submit(JobSpec(recipe="recipes/tiny.yaml", nodes=2, gpus_per_node=1, cpus_per_task=12, workdir=tmp_path,
                   overrides=[f"run_dir={tmp_path / 'run'}"]),  # not the checkout's runs/tiny, trained or not
           dry_run=True, print_fn=out.append)
    script = out[0]
    assert "#SBATCH --cpus-per-task=12" in script
    sruns = _srun_lines(script)
    assert len(sruns) == 2 and all("--cpus-per-task=12" in line for line in sruns), sruns
    first_srun = script.index(sruns[0])
    assert -1 < script.index("trap on_usr1 USR1") < first_srun
    assert -1 < script.index('export FBT_PREEMPT_FILE="$RUN_DIR/slurm/preempt.$SLURM_JOB_ID.') < first_srun


def test_min_nodes_makes_the_allocation_elastic(tmp_path, capsys):
    out = []
    submit(JobSpec(recipe="recipes/fbt-1b-400b.yaml", overrides=CLUSTER_DATA, nodes=8, min_nodes=4, gpus_per_node=8,
                   workdir=tmp_path),
           dry_run=True, print_fn=out.append)
    assert "#SBATCH --nodes=4-8" in out[0] and "--nnodes=4:8" in out[0]
    assert main(["submit", "recipes/tiny.yaml", "--nodes", "1", "--min-nodes", "2", "--gpus-per-node", "1",
                 "--cpu", "--dry-run", f"run_dir={tmp_path / 'run'}"]) == 2
    assert "--min-nodes 2 must lie in [1, --nodes 1]" in capsys.readouterr().err


def test_template_is_package_data():
    from importlib.resources import files

    from fbt_megatron.launch.submit import DEFAULT_TEMPLATE

    assert DEFAULT_TEMPLATE.read_text() == (files("fbt_megatron.launch") / "train.sbatch").read_text()
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert "train.sbatch" in pyproject["tool"]["setuptools"]["package-data"]["fbt_megatron.launch"]


def test_an_init_from_recipe_without_a_model_is_checked_against_the_checkpoints_model(tmp_path, capsys):
    """A recipe with ``init_from`` and no ``model`` section trains the checkpoint's model (train/sft.py):
    the submit's layout check uses that model, not the default one."""
    import json

    import yaml

    ckpt = tmp_path / "base" / "checkpoints" / "step_3"
    ckpt.mkdir(parents=True)
    (ckpt.parent / "latest").write_text("step_3")
    model = {"num_layers": 2, "hidden_size": 192, "num_attention_heads": 6, "vocab_size": 4096,
             "max_sequence_length": 128}
    (ckpt / "state.json").write_text(json.dumps({"step": 3, "recipe": {"model": model}}))
    recipe = {"name": "sft", "run_dir": str(tmp_path / "sft"), "init_from": str(tmp_path / "base"),
              "batch": {"global_batch_size": 4, "micro_batch_size": 1}, "data": {"seq_length": 128}}
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(recipe))
    args = lambda tp: ["submit", str(tmp_path / "sft.yaml"), "--nodes", "1", "--gpus-per-node", str(tp), "--cpu",
                       "--dry-run", f"parallel.tensor={tp}"]  # noqa: E731
    assert main(args(2)) == 0, capsys.readouterr().err
    capsys.readouterr()
    # TP=4 divides the default model (4 heads, hidden 128) but not the checkpoint's 6 heads
    assert main(args(4)) == 2
    assert "model.num_attention_heads=6 is not divisible by tensor parallel size 4" in capsys.readouterr().err


def test_submit_checks_an_sft_recipe_as_fbt_sft_does(tmp_path, capsys):
    """A `task: sft` recipe is refused at submit (not on the nodes) when it trains on no chat data or
    lets packed conversations attend to each other."""
    import yaml

    recipe = {"name": "sft", "task": "sft", "run_dir": str(tmp_path / "sft"),
              "batch": {"global_batch_size": 4, "micro_batch_size": 1}, "data": {"seq_length": 128}}
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(recipe))
    args = ["submit", str(tmp_path / "sft.yaml"), "--nodes", "1", "--gpus-per-node", "1", "--cpu", "--dry-run"]
    assert main(args) == 2
    assert "recipe key 'data.pipeline': task=sft trains on chat datasets" in capsys.readouterr().err
    assert main(args + ["task=pretrain"]) == 0, capsys.readouterr().err  # the same recipe pretrains
    capsys.readouterr()
    recipe["model"] = {"attention_mask": "causal"}
    recipe["data"] = {"seq_length": 128, "source": "pipeline",
                      "pipeline": {"sources": [{"name": "chat", "path": str(tmp_path / "chat"), "weight": 1.0}],
                                   "tokenizer": str(tmp_path / "tok.model")}}
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(recipe))
    assert main(args) == 2
    assert "recipe key 'model.attention_mask'" in capsys.readouterr().err


def test_gpu_script_environment_allocation_and_port(tmp_path):
    """A GPU job: one CUDA work queue per device (Megatron's overlap), expandable CUDA segments (1/2/3-pass
    batches), whole nodes with all their memory; a CPU job none of the CUDA settings. The rendezvous port,
    run through bash for job ids across the range, stays below Linux's ephemeral ports (32768-60999)."""
    out = []
    submit(JobSpec(recipe="recipes/fbt-1b-400b.yaml", overrides=CLUSTER_DATA, nodes=8, gpus_per_node=8, workdir=tmp_path),
           dry_run=True, print_fn=out.append)
    gpu = out[0].splitlines()
    for line in ("export CUDA_DEVICE_MAX_CONNECTIONS=1",
                 'export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"',
                 "#SBATCH --exclusive", "#SBATCH --mem=0"):
        assert line in gpu, line
    first_srun = next(i for i, line in enumerate(gpu) if line.lstrip().startswith("srun "))
    assert gpu.index("export CUDA_DEVICE_MAX_CONNECTIONS=1") < first_srun
    out.clear()
    submit(JobSpec(recipe="recipes/tiny.yaml", nodes=1, gpus_per_node=1, cpu=True, workdir=tmp_path,
                   overrides=[f"run_dir={tmp_path / 'run'}"]),
           dry_run=True, print_fn=out.append)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in out[0] and "--exclusive" not in out[0]

    port_line = next(line for line in gpu if line.startswith("export FBT_RDZV_PORT="))
    ids = [1, 12_345, 32_767, 40_000, 987_654_321, *range(0, 200_000, 997)]
    script = "for SLURM_JOB_ID in " + " ".join(map(str, ids)) + "; do " + port_line + "; echo $FBT_RDZV_PORT; done"
    ports = [int(p) for p in subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                                            check=True).stdout.split()]
    assert len(ports) == len(ids) and all(1024 < p < 32768 for p in ports), (min(ports), max(ports))


def test_a_second_submit_on_a_run_with_a_job_queued_or_running_is_refused(tmp_path, monkeypatch, capsys):
    """The run folder's jobs.jsonl names job 4242; while squeue lists it, a second submit without
    --dependency is refused in one sentence (its job would only be refused at start-up by the run's lock),
    and sbatch is not called; with --dependency, or once squeue no longer lists the job, it is submitted."""
    import os

    bin_dir, calls = tmp_path / "bin", tmp_path / "sbatch-calls"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\necho 4242\n')
    (bin_dir / "squeue").write_text(f'#!/bin/sh\ncat "{tmp_path / "queue"}"\n')
    for tool in ("sbatch", "squeue"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    run = tmp_path / "run"
    args = ["submit", "recipes/tiny.yaml", "--gpus-per-node", "1", "--cpu", f"run_dir={run}"]
    (tmp_path / "queue").write_text("")
    assert main(args) == 0 and len(calls.read_text().splitlines()) == 1  # the first job: 4242
    (tmp_path / "queue").write_text("4242 RUNNING\n")
    assert main(args) == 2
    assert capsys.readouterr().err.endswith(
        f"{run} has jobs queued or running (4242 RUNNING): wait for them or scancel them, or pass --dependency "
        "afterany:4242 to continue after them\n")
    assert len(calls.read_text().splitlines()) == 1
    assert main([*args, "--dependency", "afterany:4242"]) == 0
    (tmp_path / "queue").write_text("")
    assert main(args) == 0 and len(calls.read_text().splitlines()) == 3
