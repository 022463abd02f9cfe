"""Joint MLP (up/down) compression (LatentLLM Sec. 4.3 / App. H, generalised to gated MLPs).

Streaming variant (no stored activations): compress the input projections first, then fit down to
the *compressed* intermediate ĥ: min E‖W_d h − Ŵ ĥ‖² over rank r has the exact solution

    W* = W_d E[h ĥᵀ] E[ĥ ĥᵀ]⁻¹,  then rootcov-compress W* on E[ĥ ĥᵀ]

(E‖W_d h − Ŵĥ‖² = const + ‖(Ŵ − W*) E[ĥĥᵀ]^{1/2}‖²).

Auxiliary-variable variant (explicit activations X [d, l], columns = tokens; small scale), target
Y = W_d σ(W_u X) (or W_d (act(W_g X) ⊙ W_u X) for gated MLPs):

    L = α‖Ŵ_u X − Z‖² + β‖Z' − σ(Z)‖² + γ‖Ŵ_d Z' − Y‖²
    Z' ← (γ Ŵ_dᵀŴ_d + β I)⁻¹ (β σ(Z) + γ Ŵ_dᵀ Y)
    Z  ← elementwise argmin α(z − a)² + β(z' − σ(z))²   (ReLU: two branches in closed form;
                                                        gated SiLU/GELU: Gauss–Newton steps)
    Ŵ_u ← rank-r_u rootcov fit of the map Z X⁺;  Ŵ_d ← rank-r_d fit of Y Z'⁺ on Z'Z'ᵀ

Each iterate is scored by the true output error with down refitted to the compressed intermediate;
the best iterate is returned, and iterate 0 is the separate local rootcov SVD, so the result is never
worse than the local baseline on the calibration data (``streaming_error`` records the streaming
variant for comparison). Bias-free layers only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F

from .moments import CrossMomentAccumulator, SecondMomentAccumulator
from .svd import weighted_low_rank
from .teacher_target import fit_low_rank_map, teacher_target_factors

__all__ = [
    "DownFitMoments",
    "ACTIVATIONS",
    "JointMLPResult",
    "down_fit_error",
    "fit_down_to_compressed",
    "joint_mlp_relu",
    "joint_gated_mlp",
]

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; choose one of {sorted(ACTIVATIONS)}") from None


def fit_down_to_compressed(
    W_d: torch.Tensor,
    cross_moment: torch.Tensor,
    second_moment: torch.Tensor,
    rank: int,
    damping: float = 1e-2,
    anchored: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress down [d_out, m] for the compressed intermediate: E[h ĥᵀ] [m, m], E[ĥ ĥᵀ] [m, m] → (B, A).

    The unconstrained map is W_d E[h ĥᵀ] E[ĥ ĥᵀ]⁻¹, then rootcov (the exact rank-r optimum). Both forms
    agree without damping; they differ in what the damping pulls the map towards:
    ``anchored`` (default): W_d + W_d (E[hĥᵀ] − E[ĥĥᵀ]) (damped E[ĥĥᵀ])⁻¹ — towards W_d itself (when ĥ = h
    this is the local rootcov fit of W_d), as the teacher-target fits do (linalg/teacher_target.py);
    otherwise W_d E[hĥᵀ] (damped E[ĥĥᵀ])⁻¹ — towards zero, which also shrinks W_d in the directions where
    E[ĥĥᵀ] is below the damping.
    """
    weight = W_d.detach().to(torch.float64)
    if anchored:
        return teacher_target_factors(weight, cross_moment, second_moment, rank, damping)
    return fit_low_rank_map(weight @ cross_moment.to(weight), second_moment, rank, damping)


def down_fit_error(W_d: torch.Tensor, B: torch.Tensor, A: torch.Tensor, target_moment: torch.Tensor,
                   cross_moment: torch.Tensor, second_moment: torch.Tensor) -> float:
    """Relative output error E‖W_d h − B A ĥ‖² / E‖W_d h‖² of a down fit, from the moments of a token set:
    E[h hᵀ], E[h ĥᵀ], E[ĥ ĥᵀ] (each [m, m]); with F = B A [d_out, m]:

        E‖W_d h − F ĥ‖² = tr(W_d E[hhᵀ] W_dᵀ) − 2 tr(W_d E[hĥᵀ] Fᵀ) + tr(F E[ĥĥᵀ] Fᵀ)

    Measured on tokens the fit did not see, it is the held-out error that chooses between fits.
    """
    weight = W_d.detach().to(torch.float64)
    fit = B.detach().to(weight) @ A.detach().to(weight)
    target = ((weight @ target_moment.to(weight)) * weight).sum()
    if float(target) <= 0:
        raise ValueError("down_fit_error: E‖W_d h‖² is zero (zero weight or zero intermediate)")
    error = target - 2 * ((weight @ cross_moment.to(weight)) * fit).sum() + ((fit @ second_moment.to(weight)) * fit).sum()
    return float(error / target)


def _fit_columns(target: torch.Tensor, inputs: torch.Tensor, rank: int, damping: float) -> torch.Tensor:
    """Rank-r W minimising ‖target − W inputs‖² (columns = tokens); returns the dense B A."""
    tokens = inputs.shape[1]
    B, A = fit_low_rank_map(target @ inputs.T / tokens, inputs @ inputs.T / tokens, rank, damping)
    return B @ A


def _factor(weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact rank-r factors of an (already rank-r) dense matrix."""
    return weighted_low_rank(weight, None, rank, "plain")


def _relative_error(output: torch.Tensor, target: torch.Tensor) -> float:
    return float((output - target).pow(2).sum() / target.pow(2).sum())


def _auxiliary_output(W_d: torch.Tensor, activation_target: torch.Tensor, Y: torch.Tensor, beta: float, gamma: float):
    """Z' = (γ W_dᵀW_d + β I)⁻¹ (β σ(Z) + γ W_dᵀ Y)."""
    system = gamma * W_d.T @ W_d + beta * torch.eye(W_d.shape[1], dtype=W_d.dtype, device=W_d.device)
    return torch.linalg.solve(system, beta * activation_target + gamma * W_d.T @ Y)


def _relu_preactivation(predicted: torch.Tensor, post: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """Elementwise argmin_z α(z − a)² + β(c − relu(z))² over the two branches z ≤ 0 and z ≥ 0."""
    negative = predicted.clamp_max(0.0)  # branch z ≤ 0: relu = 0
    positive = ((alpha * predicted + beta * post) / (alpha + beta)).clamp_min(0.0)  # branch z ≥ 0

    def cost(z):
        return alpha * (z - predicted) ** 2 + beta * (post - z.clamp_min(0.0)) ** 2

    return torch.where(cost(negative) <= cost(positive), negative, positive)


@dataclass
class JointMLPResult:
    """Dense compressed weights (rank-limited) and their factors; output_errors[0] is the local baseline."""

    weights: dict[str, torch.Tensor]
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    output_errors: list[float] = field(default_factory=list)
    best_iteration: int = 0
    streaming_error: float = float("nan")  # local input projections + down refitted to them


def _check_common(X: torch.Tensor, iterations: int) -> torch.Tensor:
    if X.ndim != 2:
        raise ValueError(f"X must be [d, tokens], got shape {tuple(X.shape)}")
    if iterations < 0:
        raise ValueError(f"iterations must be >= 0, got {iterations}")
    return X.detach().to(torch.float64)


def joint_mlp_relu(
    W_u: torch.Tensor,
    W_d: torch.Tensor,
    X: torch.Tensor,
    rank_u: int,
    rank_d: int,
    iterations: int = 4,
    alpha: float = 1.0,
    beta: float = 1.0,
    gamma: float = 1.0,
    damping: float = 1e-2,
) -> JointMLPResult:
    """Joint compression of y = W_d relu(W_u x): W_u [m, d], W_d [d_out, m], X [d, l] → ranks r_u, r_d."""
    X = _check_common(X, iterations)
    W_u, W_d = W_u.detach().to(X), W_d.detach().to(X)
    Z = W_u @ X  # [m, l]
    Y = W_d @ torch.relu(Z)  # [d_out, l]

    def candidate(up_hat):
        hidden = torch.relu(up_hat @ X)
        down_hat = _fit_columns(Y, hidden, rank_d, damping)  # optimal down for this up
        return down_hat, _relative_error(down_hat @ hidden, Y)

    up_hat = _fit_columns(Z, X, rank_u, damping)
    down_aux = _fit_columns(Y, torch.relu(Z), rank_d, damping)  # local: down fitted on the original h
    local_error = _relative_error(down_aux @ torch.relu(up_hat @ X), Y)
    best = (local_error, up_hat, down_aux, 0)
    errors = [local_error]
    streaming_error = candidate(up_hat)[1]
    for iteration in range(1, iterations + 1):
        post = _auxiliary_output(down_aux, torch.relu(Z), Y, beta, gamma)
        Z = _relu_preactivation(up_hat @ X, post, alpha, beta)
        up_hat = _fit_columns(Z, X, rank_u, damping)
        down_aux = _fit_columns(Y, post, rank_d, damping)
        down_refit, error = candidate(up_hat)
        errors.append(error)
        if error < best[0]:
            best = (error, up_hat, down_refit, iteration)
    _, up_best, down_best, best_iteration = best
    weights = {"up": up_best, "down": down_best}
    factors = {"up": _factor(up_best, rank_u), "down": _factor(down_best, rank_d)}
    return JointMLPResult(weights, factors, errors, best_iteration, streaming_error)


def _gauss_newton_gate(
    predicted: torch.Tensor,
    hidden: torch.Tensor,
    up: torch.Tensor,
    start: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
    alpha: float,
    beta: float,
    steps: int,
) -> torch.Tensor:
    """Elementwise argmin_z α(z − a)² + β(h − act(z) u)² by Gauss–Newton, keeping only improving steps."""

    def cost(z):
        return alpha * (z - predicted) ** 2 + beta * (hidden - activation(z) * up) ** 2

    z = start.clone()
    for _ in range(steps):
        with torch.enable_grad():
            probe = z.detach().requires_grad_(True)
            value = activation(probe)
            (slope,) = torch.autograd.grad(value.sum(), probe)  # act'(z), elementwise
        value = value.detach()
        residual = hidden - value * up
        jacobian = slope * up
        gradient = 2 * alpha * (z - predicted) - 2 * beta * residual * jacobian
        curvature = 2 * alpha + 2 * beta * jacobian**2  # Gauss–Newton: always positive
        proposal = z - gradient / curvature
        z = torch.where(cost(proposal) < cost(z), proposal, z)
    return z


def joint_gated_mlp(
    W_g: torch.Tensor,
    W_u: torch.Tensor,
    W_d: torch.Tensor,
    X: torch.Tensor,
    rank_g: int,
    rank_u: int,
    rank_d: int,
    activation: str = "silu",
    iterations: int = 4,
    newton_steps: int = 3,
    alpha: float = 1.0,
    beta: float = 1.0,
    gamma: float = 1.0,
    damping: float = 1e-2,
) -> JointMLPResult:
    """Joint compression of y = W_d (act(W_g x) ⊙ W_u x): W_g, W_u [m, d], W_d [d_out, m], X [d, l].

    Auxiliaries Z_g, Z_u, H with L = α‖Ŵ_gX − Z_g‖² + α‖Ŵ_uX − Z_u‖² + β‖H − act(Z_g)⊙Z_u‖² + γ‖Ŵ_dH − Y‖²:
    H in closed form (as Z' above), Z_u elementwise closed form z_u = (α a_u + β s h)/(α + β s²) with
    s = act(z_g), Z_g by Gauss–Newton steps.
    """
    act = _activation(activation)
    X = _check_common(X, iterations)
    W_g, W_u, W_d = (w.detach().to(X) for w in (W_g, W_u, W_d))
    Z_g, Z_u = W_g @ X, W_u @ X
    hidden_original = act(Z_g) * Z_u
    Y = W_d @ hidden_original

    def candidate(gate_hat, up_hat):
        hidden = act(gate_hat @ X) * (up_hat @ X)
        down_hat = _fit_columns(Y, hidden, rank_d, damping)
        return down_hat, _relative_error(down_hat @ hidden, Y)

    gate_hat, up_hat = _fit_columns(Z_g, X, rank_g, damping), _fit_columns(Z_u, X, rank_u, damping)
    down_aux = _fit_columns(Y, hidden_original, rank_d, damping)
    local_error = _relative_error(down_aux @ (act(gate_hat @ X) * (up_hat @ X)), Y)
    best = (local_error, gate_hat, up_hat, down_aux, 0)
    errors = [local_error]
    streaming_error = candidate(gate_hat, up_hat)[1]
    for iteration in range(1, iterations + 1):
        hidden = _auxiliary_output(down_aux, act(Z_g) * Z_u, Y, beta, gamma)
        predicted_up, predicted_gate = up_hat @ X, gate_hat @ X
        gate_value = act(Z_g)
        Z_u = (alpha * predicted_up + beta * gate_value * hidden) / (alpha + beta * gate_value**2)
        Z_g = _gauss_newton_gate(predicted_gate, hidden, Z_u, Z_g, act, alpha, beta, newton_steps)
        gate_hat, up_hat = _fit_columns(Z_g, X, rank_g, damping), _fit_columns(Z_u, X, rank_u, damping)
        down_aux = _fit_columns(Y, hidden, rank_d, damping)
        down_refit, error = candidate(gate_hat, up_hat)
        errors.append(error)
        if error < best[0]:
            best = (error, gate_hat, up_hat, down_refit, iteration)
    _, gate_best, up_best, down_best, best_iteration = best
    weights = {"gate": gate_best, "up": up_best, "down": down_best}
    factors = {
        "gate": _factor(gate_best, rank_g),
        "up": _factor(up_best, rank_u),
        "down": _factor(down_best, rank_d),
    }
    return JointMLPResult(weights, factors, errors, best_iteration, streaming_error)


class DownFitMoments:
    """E[h ĥᵀ], E[ĥ ĥᵀ], the sum of h and, for held-out scoring, E[h hᵀ] of one set of calibration tokens."""

    def __init__(self, width: int, device, keep_target: bool):
        self.cross_accumulator = CrossMomentAccumulator(width, width, device=device)
        self.hat_accumulator = SecondMomentAccumulator(width, device=device)
        self.target_accumulator = SecondMomentAccumulator(width, device=device) if keep_target else None
        self.sum_h = torch.zeros(width, dtype=torch.float64, device=device)

    def update(self, h: torch.Tensor, h_hat: torch.Tensor) -> None:
        self.cross_accumulator.update(h, h_hat)
        self.hat_accumulator.update(h_hat)
        if self.target_accumulator is not None:
            self.target_accumulator.update(h)
        self.sum_h += h.reshape(-1, h.shape[-1]).to(torch.float64).sum(0)

    def accumulators(self) -> list:
        kept = [self.cross_accumulator, self.hat_accumulator, self.sum_h]
        return kept + ([self.target_accumulator] if self.target_accumulator is not None else [])

    @property
    def count(self) -> float:
        return self.hat_accumulator.count

    def merge(self, other: "DownFitMoments") -> None:
        self.cross_accumulator.merge(other.cross_accumulator)
        self.hat_accumulator.merge(other.hat_accumulator)
        if self.target_accumulator is not None:
            self.target_accumulator.merge(other.target_accumulator)
        self.sum_h += other.sum_h

    def moments(self, centered: bool) -> SimpleNamespace:
        """cross, hat, target (None unless kept), mean_h, mean_hat; centered (covariances) for a layer with a bias."""
        mean_h, mean_hat = self.sum_h / self.count, self.hat_accumulator.mean
        cross, hat = self.cross_accumulator.cross_moment, self.hat_accumulator.second_moment
        target = self.target_accumulator.second_moment if self.target_accumulator is not None else None
        if centered:
            cross, hat = cross - torch.outer(mean_h, mean_hat), self.hat_accumulator.covariance()
            target = self.target_accumulator.covariance() if target is not None else None
        return SimpleNamespace(cross=cross, hat=hat, target=target, mean_h=mean_h, mean_hat=mean_hat)
