"""Low-rank fits to a *teacher's* outputs from the inputs the compressed model actually produces.

Layer l of a sequentially compressed model receives x_c (made by the compressed layers < l) where the
original model receives x_t for the same token. Fitting W′ to reproduce W x_c (today's fit) keeps
the errors of layers < l; fitting it to the teacher's output W x_t corrects them (error feedback, as
in GPTQ / SVD-LLM v2):

    min_{rank W′ ≤ r}  E‖W x_t − W′ x_c‖²
      = const + ‖(W̃ − W′) C_cc^{1/2}‖²_F,   W̃ = W C_tc C_cc⁻¹,

with C_cc = E[x_c x_cᵀ] [d, d] and C_tc = E[x_t x_cᵀ] [d, d] (streamed together). W̃ is the
unconstrained optimum; the rank-r optimum is the rootcov weighted SVD of W̃ in the C_cc metric
(reduced-rank regression). It is computed as a correction of W,

    W̃ = W + W (C_tc − C_cc) (C_cc + λ·mean(diag C_cc)·I)⁻¹,

equal to W C_tc C_cc⁻¹ for λ = 0; the damping λ then only tempers the correction, so that with
x_t = x_c the fit is exactly today's rootcov fit of W (a damped W C_tc C_cc⁻¹ would shrink W itself).
The weighting uses the damped C_cc as every fit does. All float64.
"""

from __future__ import annotations

import torch

from .moments import damped
from .preconditioners import Preconditioner
from .svd import weighted_low_rank, weighted_svd

__all__ = ["fit_low_rank_map", "teacher_target_map", "teacher_target_factors"]


def fit_low_rank_map(cross_moment: torch.Tensor, second_moment: torch.Tensor, rank: int, damping: float = 1e-2,
                     preconditioner: str = "rootcov") -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-r (B [m, r], A [r, n]) minimising E‖t − B A s‖² given E[t sᵀ] [m, n] and E[s sᵀ] [n, n].

    W* = E[t sᵀ] (damped E[s sᵀ])⁻¹ is the unconstrained solution; rootcov on E[s sᵀ] then gives the
    exact rank-constrained one (another ``preconditioner`` approximates it).
    """
    moment = second_moment.to(torch.float64)
    cross = cross_moment.to(device=moment.device, dtype=torch.float64)
    unconstrained = torch.linalg.solve(damped(moment, damping), cross.T).T  # cross · C⁻¹ (C symmetric)
    return weighted_low_rank(unconstrained, moment, rank, preconditioner, damping)


def teacher_target_map(W: torch.Tensor, cross_moment: torch.Tensor, second_moment: torch.Tensor,
                       damping: float = 1e-2) -> torch.Tensor:
    """W̃ = W + W (C_tc − C_cc)(damped C_cc)⁻¹ [d′, d]: the unconstrained teacher-target map (module docstring)."""
    weight = W.detach().to(torch.float64)
    moment = second_moment.to(device=weight.device, dtype=torch.float64)
    correction = weight @ (cross_moment.to(weight) - moment)
    return weight + torch.linalg.solve(damped(moment, damping), correction.T).T


def teacher_target_factors(W: torch.Tensor, cross_moment: torch.Tensor, second_moment: torch.Tensor, rank: int,
                           damping: float = 1e-2, preconditioner: str | Preconditioner = "rootcov"
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-r (B [d′, r], A [r, d]) minimising E‖W x_t − B A x_c‖² from C_tc = E[x_t x_cᵀ] and C_cc = E[x_c x_cᵀ].

    ``preconditioner``: a registry name, or the :class:`Preconditioner` already built from the damped
    C_cc (projections that share an input share its eigendecomposition).
    """
    target = teacher_target_map(W, cross_moment, second_moment, damping)
    if isinstance(preconditioner, Preconditioner):
        return weighted_svd(target, None, preconditioner).factors(rank)
    return weighted_low_rank(target, second_moment.to(target), rank, preconditioner, damping)
