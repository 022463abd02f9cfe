"""Preconditioners P for activation-aware low-rank approximation (LatentLLM Table 1).

The weighted problem min ‖(W − BA) P‖_F is solved by U S V = svd_r(W P), B = U S, A = V P⁺.
Each entry of :data:`PRECONDITIONERS` maps a second moment C = E[x xᵀ] [d, d] (already damped by the
caller) to a :class:`Preconditioner` holding P [d, d] and its pseudo-inverse P⁺ [d, d], both float64:

    plain     P = I
    hessian   P = diag(C)
    l2        P = diag(C)^{1/2}
    cov       P = C                      (weights the error by C², not the activation loss)
    rootcov   P = C^{1/2}                (the exact minimiser of ‖(W − BA) X‖²)
    cholesky  P = L with C = L Lᵀ        (SVD-LLM whitening; same optimum as rootcov)

Pseudo-inverses come from the structure (reciprocal diagonal, reciprocal eigenvalues, triangular
solve), never from a generic pinv, so they are exact up to rounding and cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = [
    "Preconditioner",
    "PRECONDITIONERS",
    "make_preconditioner",
    "symmetric_power",
]


@dataclass(frozen=True)
class Preconditioner:
    """P [d, d] and P⁺ [d, d] (float64)."""

    P: torch.Tensor
    P_inv: torch.Tensor


def _relative_floor(values: torch.Tensor) -> torch.Tensor:
    """Values at or below this count as zero (numerical rank cut for pseudo-inverses)."""
    largest = values.abs().max() if values.numel() else torch.zeros((), dtype=values.dtype)
    return largest * values.numel() * torch.finfo(values.dtype).eps


def _safe_reciprocal(values: torch.Tensor) -> torch.Tensor:
    """1/v where v is above the numerical floor, 0 elsewhere (pseudo-inverse of a diagonal)."""
    floor = _relative_floor(values)
    keep = values > floor
    return torch.where(keep, 1.0 / torch.where(keep, values, torch.ones_like(values)), torch.zeros_like(values))


def _as_float64_square(second_moment: torch.Tensor) -> torch.Tensor:
    if second_moment.ndim != 2 or second_moment.shape[0] != second_moment.shape[1]:
        raise ValueError(f"second moment must be a square matrix, got shape {tuple(second_moment.shape)}")
    matrix = second_moment.to(torch.float64)
    return (matrix + matrix.T) / 2


def symmetric_power(matrix: torch.Tensor, power: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(M^p, (M^p)⁺) for a symmetric PSD matrix M [d, d] via eigh, eigenvalues clamped at 0.

    Negative eigenvalues (rounding on a PSD matrix) are set to 0; eigenvalues below
    d · eps · λ_max are treated as 0 in the pseudo-inverse.
    """
    matrix = _as_float64_square(matrix)
    eigenvalues, eigenvectors = torch.linalg.eigh(matrix)  # ascending, [d], [d, d]
    eigenvalues = eigenvalues.clamp_min(0.0)
    powered = eigenvalues.pow(power)
    inverse = _safe_reciprocal(eigenvalues).pow(power)
    forward = (eigenvectors * powered) @ eigenvectors.T
    backward = (eigenvectors * inverse) @ eigenvectors.T
    return forward, backward


def _plain(second_moment: torch.Tensor) -> Preconditioner:
    eye = torch.eye(second_moment.shape[0], dtype=torch.float64, device=second_moment.device)
    return Preconditioner(eye, eye.clone())


def _diagonal_power(second_moment: torch.Tensor, power: float) -> Preconditioner:
    diagonal = torch.diagonal(_as_float64_square(second_moment)).clamp_min(0.0)
    return Preconditioner(torch.diag(diagonal.pow(power)), torch.diag(_safe_reciprocal(diagonal).pow(power)))


def _hessian(second_moment: torch.Tensor) -> Preconditioner:
    return _diagonal_power(second_moment, 1.0)


def _l2(second_moment: torch.Tensor) -> Preconditioner:
    return _diagonal_power(second_moment, 0.5)


def _cov(second_moment: torch.Tensor) -> Preconditioner:
    return Preconditioner(*symmetric_power(second_moment, 1.0))


def _rootcov(second_moment: torch.Tensor) -> Preconditioner:
    return Preconditioner(*symmetric_power(second_moment, 0.5))


# Relative jitters tried when C is only positive semi-definite (SVD-LLM does the same); damping
# upstream normally makes the first attempt succeed.
_CHOLESKY_JITTERS = (0.0, 1e-12, 1e-10, 1e-8, 1e-6)


def _cholesky(second_moment: torch.Tensor) -> Preconditioner:
    matrix = _as_float64_square(second_moment)
    eye = torch.eye(matrix.shape[0], dtype=torch.float64, device=matrix.device)
    scale = torch.diagonal(matrix).mean().clamp_min(torch.finfo(torch.float64).tiny)
    for jitter in _CHOLESKY_JITTERS:
        lower, info = torch.linalg.cholesky_ex(matrix + jitter * scale * eye)
        if int(info) == 0:
            lower_inv = torch.linalg.solve_triangular(lower, eye, upper=False)
            return Preconditioner(lower, lower_inv)
    raise ValueError(
        "cholesky preconditioner: the second moment is not positive definite even with a relative jitter "
        f"of {_CHOLESKY_JITTERS[-1]:g}; use damping > 0 or the 'rootcov' preconditioner"
    )


PRECONDITIONERS: dict[str, Callable[[torch.Tensor], Preconditioner]] = {
    "plain": _plain,
    "hessian": _hessian,
    "l2": _l2,
    "cov": _cov,
    "rootcov": _rootcov,
    "cholesky": _cholesky,
}


def make_preconditioner(name: str, second_moment: torch.Tensor) -> Preconditioner:
    """Look up ``name`` in :data:`PRECONDITIONERS` and apply it to ``second_moment`` [d, d]."""
    try:
        build = PRECONDITIONERS[name]
    except KeyError:
        raise ValueError(f"unknown preconditioner {name!r}; choose one of {sorted(PRECONDITIONERS)}") from None
    return build(second_moment)
