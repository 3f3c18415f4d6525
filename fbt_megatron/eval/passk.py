"""The unbiased pass@k estimator (Chen et al. 2021, the HumanEval paper).

With n samples of which c pass, pass@k = 1 - C(n-c, k) / C(n, k): the chance that k samples drawn
without replacement contain a passing one. Computed as a product to stay exact for large n:
1 - prod_{i=n-c+1}^{n} (1 - k / i).
"""

from __future__ import annotations

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c={c} correct samples must lie in [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} must lie in [1, n={n}] (n = samples per problem)")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_pass_at_k(results: list[list[bool]], k: int) -> float:
    """Mean pass@k over problems, each given as its samples' pass/fail list."""
    return float(np.mean([pass_at_k(len(r), sum(r), k) for r in results]))
