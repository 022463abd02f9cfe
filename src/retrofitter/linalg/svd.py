"""Activation-aware truncated SVD: min over rank-r B A of ‖(W − B A) P‖_F.

With W [d', d], a preconditioner P [d, d] built from the (damped) second moment C = E[x xᵀ]:

    U S V = svd_r(W P),    B = U S  [d', r],    A = V P⁺  [r, d]

For P = C^{1/2} ("rootcov") this minimises the expected output error E‖(W − BA) x‖² = ‖(W − BA) C^{1/2}‖²
exactly (Eckart–Young on W C^{1/2}). With a bias the optimal bias for fixed BA is
b̂ = b + (W − BA) μ, and BA should then be fitted on the centered C0 = C − μ μᵀ.
Everything runs in float64.

Output side (:func:`output_side_svd`, rootcov with a damped, hence invertible, C): the left singular
vectors of W C^{1/2} are the eigenvectors of the output covariance W C Wᵀ [d', d'] with eigenvalues S², and
V P⁺ = S⁻¹ Uᵀ W P P⁻¹ = S⁻¹ Uᵀ W, so B A = U_r U_rᵀ W needs neither C^{1/2} nor an SVD: one d'×d'
eigenproblem instead of a d×d one plus the SVD; the cheaper side when d' < d (k, v and down projections).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .moments import check_finite_matrix, damped
from .preconditioners import Preconditioner, make_preconditioner

__all__ = [
    "weighted_low_rank",
    "weighted_svd",
    "output_side_svd",
    "uses_output_side",
    "cheapest_weighted_svd",
    "WeightedSVD",
    "build_preconditioner",
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


@dataclass(frozen=True)
class WeightedSVD:
    """Full thin SVD U S V of W P, from which the optimal factors of *every* rank follow by truncation.

    ``A`` = V P⁺ [k, d]: row i is the input map of component i. ``factors(r)`` = (U[:, :r] S[:r], A[:r]).
    Computing it once and truncating at several ranks (several compression ratios of one model) costs
    one SVD instead of one per ratio.
    """

    U: torch.Tensor  # [d', k]
    S: torch.Tensor  # [k], descending
    A: torch.Tensor  # [k, d] = V P⁺

    def factors(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        check_rank(rank, self.U.shape[0], self.A.shape[1])
        return self.U[:, :rank] * self.S[:rank], self.A[:rank]


def weighted_svd(
    W: torch.Tensor,
    second_moment: torch.Tensor | None,
    preconditioner: str | Preconditioner = "rootcov",
    damping: float = 1e-2,
    name: str = "matrix",
) -> WeightedSVD:
    """The SVD of W P behind :func:`weighted_low_rank` (all ranks at once), float64.

    ``preconditioner`` is a registry name, or an already built :class:`Preconditioner` (then
    ``second_moment`` and ``damping`` are not used: projections sharing one input share it).
    """
    if W.ndim != 2:
        raise ValueError(f"W must be a matrix [out, in], got shape {tuple(W.shape)}")
    weight = W.detach().to(torch.float64)
    check_finite_matrix(weight, f"{name} (weight)")
    if isinstance(preconditioner, Preconditioner):
        precond = preconditioner
    else:
        precond = build_preconditioner(second_moment, W.shape[1], preconditioner, damping, name, weight.device)
    U, S, Vh = torch.linalg.svd(weight @ precond.P.to(weight.device), full_matrices=False)
    return WeightedSVD(U, S, Vh @ precond.P_inv.to(weight.device))


def uses_output_side(out_features: int, in_features: int, preconditioner: str, damping: float) -> bool:
    """Whether :func:`output_side_svd` gives this fit: rootcov with damping > 0 (C invertible, so V P⁺ = S⁻¹ Uᵀ W)
    and fewer outputs than inputs (the d'×d' eigenproblem is the smaller one)."""
    return preconditioner == "rootcov" and damping > 0 and out_features < in_features


def cheapest_weighted_svd(W: torch.Tensor, second_moment: torch.Tensor, preconditioner: str, damping: float,
                          shared_preconditioner: Callable[[], Preconditioner], name: str = "matrix") -> WeightedSVD:
    """:func:`weighted_svd` of W [d', d] on ``second_moment`` [d, d] by the cheaper route: :func:`output_side_svd`
    where :func:`uses_output_side`, else the SVD of W P with P from ``shared_preconditioner()`` (called only
    then; callers pass one that builds P once per input and shares it between that input's projections)."""
    if uses_output_side(W.shape[0], W.shape[1], preconditioner, damping):
        return output_side_svd(W, second_moment, damping, name)
    return weighted_svd(W, second_moment, shared_preconditioner(), name=name)


def output_side_svd(W: torch.Tensor, second_moment: torch.Tensor, damping: float = 1e-2,
                    name: str = "matrix") -> WeightedSVD:
    """The rootcov :func:`weighted_svd` of W [d', d] from the output covariance (module docstring), float64:

        W C_λ Wᵀ = U S² Uᵀ  (eigh, descending),   A = S⁻¹ Uᵀ W  [k, d],   C_λ = C + λ·mean(diag C)·I

    with k = min(d', d) components; those with S² at or below d'·eps·S²_max (W rank-deficient: U_iᵀ W = 0)
    get S_i = 0 and A_i = 0. Singular values come out to an absolute ~√eps·S_max (those of
    :func:`weighted_svd` to eps·S_max): the same factors for every rank that has signal. Needs ``damping``
    > 0 (C_λ invertible); the factors equal :func:`weighted_svd`'s up to the sign of each component.
    """
    if damping <= 0:
        raise ValueError("output_side_svd needs damping > 0 (an invertible damped second moment)")
    weight = W.detach().to(torch.float64)
    check_finite_matrix(weight, f"{name} (weight)")
    if tuple(second_moment.shape) != (weight.shape[1], weight.shape[1]):
        raise ValueError(f"second moment shape {tuple(second_moment.shape)} does not match W's input dim "
                         f"{weight.shape[1]}")
    moment = second_moment.detach().to(device=weight.device, dtype=torch.float64)
    check_finite_matrix(moment, f"{name} (second moment)")
    output_covariance = weight @ damped(moment, damping) @ weight.T  # [d', d']
    eigenvalues, eigenvectors = torch.linalg.eigh((output_covariance + output_covariance.T) / 2)  # ascending
    k = min(weight.shape)
    energies = eigenvalues.flip(0)[:k]  # S² [k], descending
    # eigh resolves S² to d'·eps·S²_max: below that a component is W's null space (S = 0, A_i = 0)
    kept = energies > energies.max().clamp_min(0.0) * weight.shape[0] * torch.finfo(torch.float64).eps
    S = torch.where(kept, energies, torch.zeros_like(energies)).sqrt()
    U = eigenvectors.flip(1)[:, :k]  # [d', k]
    inverse = torch.where(kept, 1.0 / torch.where(kept, S, torch.ones_like(S)), torch.zeros_like(S))
    return WeightedSVD(U, S, inverse[:, None] * (U.T @ weight))


def build_preconditioner(second_moment: torch.Tensor | None, in_features: int, preconditioner: str = "rootcov",
                         damping: float = 1e-2, name: str = "matrix", device=None) -> Preconditioner:
    """P for the damped C + damping·mean(diag C)·I (``None``: C = I), NaN/Inf named by ``name``."""
    if second_moment is None:
        moment = torch.eye(in_features, dtype=torch.float64, device=device)
    else:
        if tuple(second_moment.shape) != (in_features, in_features):
            raise ValueError(
                f"second moment shape {tuple(second_moment.shape)} does not match W's input dim {in_features}"
            )
        moment = second_moment.detach().to(device=device, dtype=torch.float64)
        check_finite_matrix(moment, f"{name} (second moment)")
        moment = damped(moment, damping)
    return make_preconditioner(preconditioner, moment)


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
    check_rank(rank, *W.shape)
    return weighted_svd(W, second_moment, preconditioner, damping, name).factors(rank)


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
