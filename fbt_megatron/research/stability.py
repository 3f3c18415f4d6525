"""Stability estimators for the pass-to-pass map (DEQ / Huginn tooling).

- :func:`relative_residuals`: ||h^{k+1} - h^k|| / ||h^k|| along a sequence of iterates.
- :func:`contraction_ratios`: successive residual ratios r_{k+1} / r_k (< 1: the iteration contracts).
- :func:`power_spectral_norm`: the largest singular value of a map's Jacobian at a point, by power
  iteration on J^T J (a central-difference J v and an exact reverse-mode J^T u per step; no
  Jacobian is materialised).
- :func:`hutchinson_frobenius`: ||J||_F^2 estimated as E||J^T u||^2 over Rademacher u.

In a Jacobi sweep the error of position t at pass k+1 is J_t times the error of position t-1 at pass
k, where J_t = d h_t / d h_{t-1} is the one-step map. So the spectral norm of J_t is what decides
whether the residual falls geometrically before the exactness front (after S passes every position
is exact whatever the weights) arrives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def relative_residuals(iterates: Sequence[torch.Tensor]) -> list[float]:
    out = []
    for prev, nxt in zip(iterates[:-1], iterates[1:]):
        out.append(float((nxt - prev).norm() / prev.norm().clamp_min(1e-30)))
    return out


def contraction_ratios(residuals: Sequence[float], floor: float = 1e-12) -> list[float | None]:
    """r_{k+1} / r_k; None where r_k is at the numerical floor (the ratio is then noise)."""
    return [None if a <= floor else b / a for a, b in zip(residuals[:-1], residuals[1:])]


def _jvp(fn, x: torch.Tensor, v: torch.Tensor, eps: float = 1e-3) -> torch.Tensor:
    """J v by a central difference. Megatron's layers are autograd Functions without forward-mode
    (functorch) support, so the forward product is numerical; the reverse product is exact."""
    h = eps * max(float(x.norm()), 1.0) / max(float(v.norm()), 1e-30)
    with torch.no_grad():
        return (fn(x + h * v) - fn(x - h * v)) / (2 * h)


def _vjp(fn, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """J^T u by reverse mode."""
    with torch.enable_grad():
        xg = x.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(fn(xg), xg, grad_outputs=u)
    return g


def power_spectral_norm(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, iters: int = 30,
                        seed: int = 0, tol: float = 1e-6) -> float:
    """sigma_max of d fn / d x at x (fn: tensor -> tensor), by power iteration on J^T J."""
    x = x.detach()
    g = torch.Generator(device=x.device).manual_seed(seed)
    v = torch.randn(x.shape, generator=g, dtype=x.dtype, device=x.device)
    v = v / v.norm()
    sigma = 0.0
    for _ in range(iters):
        jv = _jvp(fn, x, v)
        jtjv = _vjp(fn, x, jv)
        new_sigma = float(jv.norm())  # ||J v|| with ||v|| = 1: sigma_max from below
        norm = jtjv.norm()
        if norm == 0:
            return 0.0
        v = jtjv / norm
        converged = abs(new_sigma - sigma) <= tol * max(new_sigma, 1e-30)
        sigma = new_sigma
        if converged:
            break
    return sigma


def hutchinson_frobenius(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, samples: int = 16,
                         seed: int = 0) -> float:
    """||J||_F at x: sqrt of the mean of ||J^T u||^2 over Rademacher vectors u (exact reverse products)."""
    x = x.detach()
    with torch.no_grad():
        y = fn(x)
    g = torch.Generator(device=x.device).manual_seed(seed)
    total = 0.0
    for _ in range(samples):
        u = torch.randint(0, 2, y.shape, generator=g, device=y.device).to(y.dtype) * 2 - 1
        total += float(_vjp(fn, x, u).pow(2).sum())
    return (total / samples) ** 0.5
