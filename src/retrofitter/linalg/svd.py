"""Activation-aware truncated SVD: min over rank-r B A of ‖(W − B A) P‖_F.

With W [d', d], a preconditioner P [d, d] built from the (damped) second moment C = E[x xᵀ]:

    U S V = svd_r(W P),    B = U S  [d', r],    A = V P⁺  [r, d]

For P = C^{1/2} ("rootcov") this minimises the expected output error E‖(W − BA) x‖² = ‖(W − BA) C^{1/2}‖²
exactly (Eckart–Young on W C^{1/2}). With a bias the optimal bias for fixed BA is
b̂ = b + (W − BA) μ, and BA should then be fitted on the centered C0 = C − μ μᵀ.
Everything runs in float64.
"""

from __future__ import annotations

import torch

from .moments import check_finite_matrix, damped
from .preconditioners import make_preconditioner

__all__ = [
    "weighted_low_rank",
    "rootcov_svd",
    "bias_compensation",
    "proxy_error",
    "check_rank",
]


def check_rank(rank: int, out_features: int, in_features: int) -> None:
    """Raise ``ValueError`` unless 1 ≤ rank ≤ min(out_features, in_features)."""
    limit = min(out_features, in_features)
    if not 1 <= int(rank) <= limit:
        raise ValueError(
            f"rank must be in [1, {limit}] for a {out_features}x{in_features} matrix, got {rank}"
        )


def weighted_low_rank(
    W: torch.Tensor,
    second_moment: torch.Tensor | None,
    rank: int,
    preconditioner: str = "rootcov",
    damping: float = 1e-2,
    name: str = "matrix",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-``rank`` factors (B [d', r], A [r, d]) minimising ‖(W − B A) P‖_F, float64.

    ``second_moment`` is C = E[x xᵀ] [d, d] (``None`` means C = I, i.e. plain SVD); it is damped
    as C + damping · mean(diag C) · I before the preconditioner ``preconditioner`` (a key of
    :data:`~retrofitter.linalg.preconditioners.PRECONDITIONERS`) is built from it. ``name`` (the
    layer) appears in the error raised for NaN/Inf in W or C.
    """
    if W.ndim != 2:
        raise ValueError(f"W must be a matrix [out, in], got shape {tuple(W.shape)}")
    out_features, in_features = W.shape
    check_rank(rank, out_features, in_features)
    weight = W.detach().to(torch.float64)
    check_finite_matrix(weight, f"{name} (weight)")
    if second_moment is None:
        moment = torch.eye(in_features, dtype=torch.float64, device=weight.device)
    else:
        if tuple(second_moment.shape) != (in_features, in_features):
            raise ValueError(
                f"second moment shape {tuple(second_moment.shape)} does not match W's input dim {in_features}"
            )
        moment = second_moment.detach().to(device=weight.device, dtype=torch.float64)
        check_finite_matrix(moment, f"{name} (second moment)")
        moment = damped(moment, damping)
    precond = make_preconditioner(preconditioner, moment)
    U, S, Vh = torch.linalg.svd(weight @ precond.P, full_matrices=False)
    B = U[:, :rank] * S[:rank]  # [d', r]
    A = Vh[:rank] @ precond.P_inv  # [r, d]
    return B, A


def rootcov_svd(
    W: torch.Tensor, second_moment: torch.Tensor, rank: int, damping: float = 1e-2
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weighted_low_rank`` with P = C^{1/2} (the exact activation-loss minimiser)."""
    return weighted_low_rank(W, second_moment, rank, preconditioner="rootcov", damping=damping)


def bias_compensation(
    W: torch.Tensor,
    B: torch.Tensor,
    A: torch.Tensor,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
) -> torch.Tensor:
    """b̂ = b + (W − B A) μ  [d'] (float64); ``bias`` None counts as 0.

    This is the bias that makes the mean output of the low-rank layer equal the original's.
    """
    weight = W.detach().to(torch.float64)
    mu = mean.detach().to(device=weight.device, dtype=torch.float64)
    # W μ − B (A μ): never forms the d'×d product B A.
    correction = weight @ mu - B.detach().to(weight) @ (A.detach().to(weight) @ mu)
    if bias is None:
        return correction
    return bias.detach().to(device=weight.device, dtype=torch.float64) + correction


def proxy_error(W: torch.Tensor, B: torch.Tensor, A: torch.Tensor, second_moment: torch.Tensor) -> float:
    """Relative activation error trace(E C Eᵀ) / trace(W C Wᵀ) with E = W − B A.

    Equals ‖(W − BA) C^{1/2}‖² / ‖W C^{1/2}‖² = E‖(W − BA)x‖² / E‖W x‖².
    """
    weight = W.detach().to(torch.float64)
    moment = second_moment.detach().to(device=weight.device, dtype=torch.float64)
    error = weight - B.detach().to(weight) @ A.detach().to(weight)
    numerator = ((error @ moment) * error).sum()
    denominator = ((weight @ moment) * weight).sum()
    if float(denominator) <= 0:
        raise ValueError("proxy_error: trace(W C Wᵀ) is zero (zero weight or zero inputs)")
    return float(numerator / denominator)
