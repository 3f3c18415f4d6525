"""On a real (local, one-node) SLURM: `fbt slurm submit-prepare --array 3` runs the count and tokenize
stages as SLURM job arrays (sbatch --array, SLURM_ARRAY_TASK_ID) and the merge as a job after them; the
dataset is the token stream of a one-process prepare. A tokenize task killed part-way (scancel of that
array task) cancels the merge; the same command again resumes: the finished slices and the killed task's
finished shards are kept, and the result is the same stream again."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.array_helpers import SHARD, TEXTS, assert_same_stream, write_corpus

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[2]
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from data_pipeline.prepare import prepare_dataset
    from tests.support.data_fixtures import train_hf_bpe

    root = tmp_path_factory.mktemp("slurm_prepare")
    inputs = write_corpus(root / "in")
    tok = train_hf_bpe(TEXTS, root / "tok", vocab_size=200)
    prepare_dataset(inputs, root / "ref", tok, name="corpus", shard_bytes=SHARD, progress=False)
    return {"inputs": inputs, "tok": tok, "ref": root / "ref"}


def _submit(corpus, out: Path, *extra: str, env=None) -> dict[str, str]:
    cmd = [sys.executable, "-m", "fbt_megatron.cli", "slurm", "submit-prepare", "--array", "3",
           "--input", *corpus["inputs"], "--tokenizer", str(corpus["tok"]), "--out", str(out), "--name", "corpus",
           "--shard-mb", repr(SHARD / (1 << 20)), "--time", "00:10:00", *extra]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    jobs = dict(re.findall(r"submitted corpus-(\w+): job (\d+)", r.stdout))
    assert set(jobs) == {"count", "tokenize", "merge"}, r.stdout
    return jobs


def _states(job: str) -> list[str]:
    """JobState of the job, or of each task of an array job."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True).stdout
    return re.findall(r"JobState=(\w+)", out)


def _wait(cond, timeout: float, what: str, logs: Path):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.5)
    tails = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(logs.glob("*.out")))
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{tails}")


def _done(job: str) -> bool:
    states = _states(job)
    return bool(states) and all(s in TERMINAL for s in states)


def test_array_prepare_equals_one_process(slurm_cluster, corpus, tmp_path):
    out = tmp_path / "out"
    jobs = _submit(corpus, out)
    logs = tmp_path / "out.array" / "logs"
    _wait(lambda: _done(jobs["merge"]), 600, "the merge job", logs)
    assert _states(jobs["count"]) == ["COMPLETED"] * 3 and _states(jobs["tokenize"]) == ["COMPLETED"] * 3
    assert _states(jobs["merge"]) == ["COMPLETED"], sorted(p.read_text()[-2000:] for p in logs.glob("*merge*"))
    # each slice was tokenized by its own array task
    task_logs = sorted(p.name for p in logs.glob("corpus-tokenize-*.out"))
    assert task_logs == [f"corpus-tokenize-{jobs['tokenize']}_{i}.out" for i in range(3)]
    assert_same_stream(out, corpus["ref"], corpus["tok"])
    # the same command once more: nothing to do
    r = subprocess.run([sys.executable, "-m", "fbt_megatron.cli", "slurm", "submit-prepare", "--array", "3",
                        "--input", *corpus["inputs"], "--tokenizer", str(corpus["tok"]), "--out", str(out),
                        "--name", "corpus", "--shard-mb", repr(SHARD / (1 << 20))],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "prepared already" in r.stdout and "submitted corpus" not in r.stdout, r.stdout + r.stderr


def test_killed_task_resumes(slurm_cluster, corpus, tmp_path):
    from data_pipeline.array import _read_json

    out, adir = tmp_path / "out", tmp_path / "out.array"
    env = dict(os.environ, FBT_TEST_HOLD_PREPARE_TASK="1", FBT_TEST_HOLD_PREPARE_SHARDS="2")
    jobs = _submit(corpus, out, "--module", "tests.support.hold_prepare", env=env)
    logs = adir / "logs"
    _wait(lambda: (adir / "held_1").exists(), 600, "task 1 to hold after 2 shards", logs)
    # another submission (other settings) while the array runs: refused before the plan or its work is touched
    plan = (adir / "plan.json").read_text()
    r = subprocess.run([sys.executable, "-m", "fbt_megatron.cli", "slurm", "submit-prepare", "--array", "2",
                        "--input", *corpus["inputs"], "--tokenizer", str(corpus["tok"]), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "still queued or running" in r.stderr and jobs["tokenize"] in r.stderr, r.stderr
    assert (adir / "plan.json").read_text() == plan and len(list((adir / "shards").glob("shard-*.tar"))) >= 2
    subprocess.run(["scancel", f"{jobs['tokenize']}_1"], check=True)  # kill that array task
    _wait(lambda: _done(jobs["tokenize"]) and _done(jobs["merge"]), 300, "the array to end", logs)
    assert _states(jobs["tokenize"]).count("CANCELLED") == 1 and _states(jobs["tokenize"]).count("COMPLETED") == 2
    assert _states(jobs["merge"]) == ["CANCELLED"]  # afterok on a failed array (kill_invalid_depend)
    assert not out.exists() and not (adir / "done" / "slice-00001.json").exists()
    shards = adir / "shards"
    kept = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in shards.glob("shard-*.tar")}
    done = {j: (adir / "done" / f"slice-{j:05d}.json").stat().st_mtime_ns for j in (0, 2)}
    first1 = len(_read_json(adir / "done" / "slice-00000.json")["infos"])
    assert len(kept) == first1 + 2 + len(_read_json(adir / "done" / "slice-00002.json")["infos"])

    again = _submit(corpus, out)  # the same command, without the hold
    _wait(lambda: _done(again["merge"]), 600, "the resubmitted merge", logs)
    assert _states(again["merge"]) == ["COMPLETED"], sorted(p.read_text()[-2000:] for p in logs.glob("*.out"))
    rec = _read_json(adir / "done" / "slice-00001.json")
    assert rec["kept_shards"] == 2 and len(rec["infos"]) > 2
    for j in (0, 2):  # finished slices were not redone
        assert (adir / "done" / f"slice-{j:05d}.json").stat().st_mtime_ns == done[j]
        assert f'"task": {j}, "shards"' in (logs / f"corpus-tokenize-{again['tokenize']}_{j}.out").read_text()
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("shard-*.tar")}
    assert all(after[k] == v for k, v in kept.items())  # the same files, moved into place, never rewritten
    assert_same_stream(out, corpus["ref"], corpus["tok"])
