"""`fbt slurm submit --dry-run` renders valid batch scripts for the big recipes; bad input is refused."""

import subprocess

import pytest

from fbt_megatron.launch.cli import main
from fbt_megatron.launch.submit import JobSpec, submit


@pytest.mark.parametrize("recipe,nodes", [("fbt-1b-400b", 8), ("fbt-3b", 16), ("fbt-7b", 32), ("fbt-13b", 64)])
def test_big_recipes_render_for_their_layout(recipe, nodes, tmp_path):
    out = []
    recs = submit(JobSpec(recipe=f"recipes/{recipe}.yaml", nodes=nodes, gpus_per_node=8, workdir=tmp_path,
                          time="24:00:00"), phases=True, dry_run=True, print_fn=out.append)
    assert [r["phase"] for r in recs] == [1, 2]
    p1, p2 = out
    assert f"#SBATCH --nodes={nodes}" in p1 and "#SBATCH --gpus-per-node=8" in p1
    assert "#SBATCH --signal=B:USR1@300" in p1 and "#SBATCH --requeue" in p1
    assert "train.stop_at_step=" in p1 and "train.stop_at_step=" not in p2
    assert "#SBATCH --dependency=afterok:<phase1>" in p2
    assert '--rdzv-endpoint="$FBT_RDZV_HOST:$FBT_RDZV_PORT"' in p1 and "FBT_RDZV_PORT=$(( 20000 + SLURM_JOB_ID % 20000 ))" in p1
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
