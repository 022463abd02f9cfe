"""The statistics of one projection input, as a fit reads them: what it weights by and what it approximates.

A fit of W [d', d] from the input x [d] of the compressed model's layer needs

    moment(centered)        the metric C [d, d]: E[x xᵀ], or Cov(x) for a layer with a bias (the bias absorbs
                            the mean)
    target(W, centered)     the map the factors B A should reproduce from x
    compensated_bias(W, b, B, A)  the bias b̂ that makes the mean output right

Two kinds (pipelines/layer_statistics.py collects them):

* :class:`InputMoments` — x is the input the fit sees and W x the output to keep (statistics "compressed",
  "teacher" and precomputed): target W, b̂ = b + (W − B A) μ;
* :class:`PairedInputMoments` — teacher targets (``statistics="teacher_target"``, linalg/teacher_target.py):
  x_c is the compressed model's input and W x_t the original model's output for the same token. The target
  is W̃ = W + W(C_tc − C_cc)(damped C_cc)⁻¹ (C_tc = E[x_t x_cᵀ], both centered with a bias), the metric
  C_cc, and b̂ = b + W μ_t − B A μ_c.

``weighted_svd`` is the full weighted SVD of the target in that metric: by the cheaper route for plain
moments (linalg.svd.cheapest_weighted_svd), always as the SVD of W̃ P for teacher targets (P from the damped
C_cc, shared between the projections of one input). All float64.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..linalg.moments import CrossMomentAccumulator, SecondMomentAccumulator
from ..linalg.preconditioners import Preconditioner
from ..linalg.svd import WeightedSVD, bias_compensation, cheapest_weighted_svd, weighted_svd
from ..linalg.teacher_target import teacher_target_map

__all__ = ["InputMoments", "PairedInputMoments"]


@dataclass
class InputMoments:
    """Second moments of the input x the fit sees; the fit keeps W's own outputs W x."""

    accumulator: SecondMomentAccumulator  # E[x xᵀ] [d, d], mean μ [d]
    entry_fields = {}  # nothing to add to the report entries of its fits

    def moment(self, centered: bool) -> torch.Tensor:
        """C = E[x xᵀ], or Cov(x) = C − μμᵀ when ``centered`` [d, d]."""
        return self.accumulator.covariance() if centered else self.accumulator.second_moment

    def target(self, weight: torch.Tensor, centered: bool, damping: float) -> torch.Tensor:
        """W itself [d', d]."""
        return weight

    def weighted_svd(self, target: torch.Tensor, moment: torch.Tensor, preconditioner: str, damping: float,
                     shared_preconditioner: Callable[[], Preconditioner], name: str) -> WeightedSVD:
        """The weighted SVD of ``target`` on ``moment`` by the cheaper route (the output side where it applies)."""
        return cheapest_weighted_svd(target, moment, preconditioner, damping, shared_preconditioner, name)

    def compensated_bias(self, linear: nn.Module, B: torch.Tensor, A: torch.Tensor) -> torch.Tensor | None:
        """b̂ = b + (W − B A) μ [d'] (float64); None without a bias."""
        if linear.bias is None:
            return None
        return bias_compensation(linear.weight, B, A, linear.bias.detach(), self.accumulator.mean)


@dataclass
class PairedInputMoments:
    """Teacher-target statistics of one input: x_c the fit sees, x_t the original model's (module docstring)."""

    accumulator: SecondMomentAccumulator  # C_cc = E[x_c x_cᵀ] [d, d], mean μ_c [d]
    teacher_mean: torch.Tensor  # μ_t = E[x_t] [d], float64
    cross: CrossMomentAccumulator  # C_tc = E[x_t x_cᵀ] [d, d]
    entry_fields = {"method": "teacher_target"}

    def moment(self, centered: bool) -> torch.Tensor:
        """C_cc, or Cov(x_c) when ``centered`` [d, d]."""
        return self.accumulator.covariance() if centered else self.accumulator.second_moment

    def target(self, weight: torch.Tensor, centered: bool, damping: float) -> torch.Tensor:
        """W̃ = W + W(C_tc − C_cc)(damped C_cc)⁻¹ [d', d] float64; centered: Cov(x_t, x_c) and Cov(x_c)."""
        cross_moment = self.cross.cross_moment
        if centered:
            cross_moment = cross_moment - torch.outer(self.teacher_mean, self.accumulator.mean)
        return teacher_target_map(weight, cross_moment, self.moment(centered), damping)

    def weighted_svd(self, target: torch.Tensor, moment: torch.Tensor, preconditioner: str, damping: float,
                     shared_preconditioner: Callable[[], Preconditioner], name: str) -> WeightedSVD:
        """The SVD of W̃ P, P from the damped C_cc (``shared_preconditioner()``)."""
        return weighted_svd(target, None, shared_preconditioner())

    def compensated_bias(self, linear: nn.Module, B: torch.Tensor, A: torch.Tensor) -> torch.Tensor | None:
        """b̂ = b + W μ_t − B A μ_c [d'] (float64); None without a bias."""
        if linear.bias is None:
            return None
        weight = linear.weight.detach().to(torch.float64)
        return (linear.bias.detach().to(weight) + weight @ self.teacher_mean.to(weight)
                - B @ (A @ self.accumulator.mean.to(weight)))
