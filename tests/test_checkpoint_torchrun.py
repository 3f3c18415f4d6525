"""The documented command end to end: `torchrun --nproc-per-node 2 -m fbt_megatron.cli train recipes/tiny.yaml`
saves and resumes at DP=2 under every ZeRO stage (a chain of short runs in one run dir, each resuming the
previous stage's checkpoint and saving its own), then `fbt ckpt inspect` / `fbt ckpt verify` on the result.

Uses the embedded token mix in data/embedded (built on first use, about 2 minutes once per checkout)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fbt_megatron.checkpoint import cli as ckpt_cli

ROOT = Path(__file__).resolve().parents[1]
CHAIN = [(1, 4), (2, 6), (3, 8), (0, 10), (1, 12)]  # (ZeRO stage, train.steps): save every 2 steps


def _torchrun(run_dir: Path, zero: int, steps: int) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "fbt_megatron.cli", "train", "recipes/tiny.yaml",
           f"run_dir={run_dir}", f"parallel.zero_stage={zero}", f"train.steps={steps}", "checkpoint.every=2",
           "eval.at_end=false", "data.valid_sequences=8", "logging.tensorboard=false", "logging.log_every=1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), FBT_DEVICE="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stderr + proc.stdout  # progress is logged to stderr, the summary printed to stdout


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("torchrun") / "run"
    return run_dir, [_torchrun(run_dir, zero, steps) for zero, steps in CHAIN]


def test_every_zero_stage_saves_and_resumes_at_dp2(chain):
    run_dir, logs = chain
    assert "checkpoint saved" in logs[0] and "resumed" not in logs[0]
    for (prev_zero, prev_steps), (zero, steps), log in zip(CHAIN, CHAIN[1:], logs[1:]):
        m = re.search(r"resumed from (\S+) at step (\d+) \(saved with (.*?), now tp=1 (?:pp=1 )?dp=(\d) zero=(\d)\)", log)
        assert m, log[-2000:]
        assert m.group(1).endswith(f"step_{prev_steps:08d}") and int(m.group(2)) == prev_steps
        assert f"'zero_stage': {prev_zero}" in m.group(3) and f"'data': 2" in m.group(3)
        assert (m.group(4), m.group(5)) == ("2", str(zero))
        assert f"step {prev_steps + 1:>6d}/{steps}" in log and f"steps             {steps}/{steps}" in log
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{CHAIN[-1][1]:08d}"


def test_ckpt_inspect_and_verify(chain, capsys, tmp_path):
    run_dir, _ = chain
    assert ckpt_cli.main(["inspect", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"step         {CHAIN[-1][1]}" in out and "'zero_stage': 1" in out and "'data': 2" in out
    assert "optimizer.exp_avg_sq." in out and "data cursor" in out and '"name": "tiny"' in out
    assert ckpt_cli.main(["verify", str(run_dir)]) == 0
    assert capsys.readouterr().out.strip().endswith("OK")
    # One flipped byte in a copy: verify names the file and both CRCs.
    bad = tmp_path / "bad"
    shutil.copytree(run_dir / "checkpoints" / f"step_{CHAIN[-1][1]:08d}", bad)
    shard = sorted((bad / "weights").glob("*.distcp"))[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert ckpt_cli.main(["verify", str(bad), "--no-model"]) == 1
    out = capsys.readouterr().out
    assert str(shard) in out and "CRC-32" in out and "expected" in out
