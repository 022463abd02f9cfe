"""Joint query/key compression (LatentLLM Algorithm 1 with the corrected transpose, Appendix E/F).

Per query head i with key head g(i) = i // (h/g) (GQA), whitening R = C^{1/2} of the damped input
second moment C [d, d], and optional RoPE relative rotations R_δ [dh, dh] between q and k heads:

    U_i = R W_{q,i}ᵀ [d, dh],  V_g = R W_{k,g}ᵀ [d, dh],  G_{i,δ} = U_i R_δ V_gᵀ   (pre-softmax scores, whitened)

Row-orthonormal Q [r_q, d], K [r_k, d] maximise Σ_{i,δ} ‖Q G_{i,δ} Kᵀ‖² (see linalg/tucker.py). Factors:

    A_q = Q R⁻¹ [r_q, d],  A_k = K R⁻¹ [r_k, d]                   (shared input factors; junction applies)
    B_{q,i} = W_{q,i} R Qᵀ [dh, r_q],  B_{k,g} = W_{k,g} R Kᵀ [dh, r_k]   (per head, stacked → [h·dh, r_q], [g·dh, r_k])

so q_proj ≈ B_q A_q and k_proj ≈ B_k A_k, RoPE still applied per head after decompression, and the
whitened score map becomes Qᵀ(Q G K ᵀ)K (its optimal Tucker core). The score error of any factors
is computed through dh×dh products only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .moments import check_finite_matrix, damped
from .preconditioners import symmetric_power
from .tucker import factored_inner, tucker2_factored

__all__ = ["JointQKFactors", "JointQKSolver", "rope_relative_rotations", "gqa_group_index", "whitening"]


def whitening(second_moment: torch.Tensor, d: int, damping: float, name: str, device
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(C, R, R⁻¹) in float64 with R = (C + λ·mean(diag C)·I)^{1/2}, C the [d, d] input second moment.

    The joint head solvers work on whitened weights R Wᵀ: ‖(W − Ŵ) x‖ in expectation = ‖(W − Ŵ) R‖_F.
    """
    if tuple(second_moment.shape) != (d, d):
        raise ValueError(f"{name}: second moment {tuple(second_moment.shape)} does not match input dim {d}")
    moment = second_moment.detach().to(device=device, dtype=torch.float64)
    check_finite_matrix(moment, f"{name} (second moment)")
    root, root_inv = symmetric_power(damped(moment, damping), 0.5)
    return moment, root, root_inv


def gqa_group_index(n_heads: int, n_kv_heads: int, device=None) -> torch.Tensor:
    """g(i) = i // (h / g) as a long tensor [h]."""
    if n_heads % n_kv_heads != 0:
        raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
    return torch.arange(n_heads, device=device) // (n_heads // n_kv_heads)


def rope_relative_rotations(head_dim: int, base: float, distances: Sequence[int]) -> list[torch.Tensor]:
    """R_δ [dh, dh] (float64) with (rope_n q)·(rope_m k) = qᵀ R_δ k for distance n − m (HF rotate_half layout).

    Dimension pairs (j, j + dh/2) rotate by angle θ_j·p, θ_j = base^(−2j/dh); the relative rotation
    for a query at n and key at m = n − distance is the rotation by −distance·θ_j.
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    half = head_dim // 2
    frequencies = base ** (-torch.arange(half, dtype=torch.float64) * 2 / head_dim)  # [dh/2]
    rotations = []
    for distance in distances:
        angle = -float(distance) * frequencies
        cos, sin = torch.cos(angle), torch.sin(angle)
        rotation = torch.zeros(head_dim, head_dim, dtype=torch.float64)
        index = torch.arange(half)
        rotation[index, index] = cos
        rotation[index + half, index + half] = cos
        rotation[index, index + half] = -sin
        rotation[index + half, index] = sin
        rotations.append(rotation)
    return rotations


@dataclass
class JointQKFactors:
    """A_q [r_q, d], A_k [r_k, d], B_q [h·dh, r_q], B_k [g·dh, r_k] (float64) and the solver's log."""

    A_q: torch.Tensor
    A_k: torch.Tensor
    B_q: torch.Tensor
    B_k: torch.Tensor
    objective_history: list[float] = field(default_factory=list)
    total_energy: float = 0.0


class JointQKSolver:
    """Tucker-2 of the whitened per-head score maps; see the module docstring for the formulas."""

    def __init__(
        self,
        W_q: torch.Tensor,
        W_k: torch.Tensor,
        second_moment: torch.Tensor,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        rank_q: int,
        rank_k: int,
        iterations: int = 8,
        damping: float = 1e-2,
        rope_rotations: Sequence[torch.Tensor] | None = None,
        name: str = "attention",
    ):
        d = W_q.shape[1]
        if tuple(W_q.shape) != (n_heads * head_dim, d) or tuple(W_k.shape) != (n_kv_heads * head_dim, d):
            raise ValueError(
                f"{name}: W_q {tuple(W_q.shape)} / W_k {tuple(W_k.shape)} do not match "
                f"{n_heads} heads, {n_kv_heads} kv heads of dim {head_dim}"
            )
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.rank_q, self.rank_k, self.iterations = rank_q, rank_k, iterations
        self.W_q = W_q.detach().to(torch.float64)
        self.W_k = W_k.detach().to(device=self.W_q.device, dtype=torch.float64)
        self.second_moment, self.root, self.root_inv = whitening(second_moment, d, damping, name, self.W_q.device)
        self.group_index = gqa_group_index(n_heads, n_kv_heads, device=self.W_q.device)
        self.middles = None
        if rope_rotations is not None:
            self.middles = torch.stack([r.to(self.W_q) for r in rope_rotations])  # [D, dh, dh]

    def _heads(self, weight: torch.Tensor, count: int) -> torch.Tensor:
        """[count·dh, d] → per-head transposes [count, d, dh]."""
        return weight.reshape(count, self.head_dim, -1).transpose(1, 2)

    def solve(self) -> JointQKFactors:
        """Run the alternating updates; returns the factors and the (non-decreasing) objective log."""
        lefts = self.root @ self._heads(self.W_q, self.n_heads)  # U_i [h, d, dh]
        rights = self.root @ self._heads(self.W_k, self.n_kv_heads)  # V_g [g, d, dh]
        result = tucker2_factored(
            lefts, rights, self.group_index, self.rank_q, self.rank_k, self.iterations, self.middles
        )
        Q, K = result.left, result.right
        A_q, A_k = Q @ self.root_inv, K @ self.root_inv
        B_q = self.W_q @ self.root @ Q.T  # [h·dh, r_q]
        B_k = self.W_k @ self.root @ K.T  # [g·dh, r_k]
        return JointQKFactors(A_q, A_k, B_q, B_k, result.objective_history, result.total_energy)

    def score_error(
        self,
        A_q: torch.Tensor,
        B_q: torch.Tensor,
        A_k: torch.Tensor,
        B_k: torch.Tensor,
        second_moment: torch.Tensor | None = None,
    ) -> float:
        """Σ_{i,δ} ‖S (W_qiᵀ R_δ W_kg − Ŵ_qiᵀ R_δ Ŵ_kg) S‖² / Σ_{i,δ} ‖S W_qiᵀ R_δ W_kg S‖², S = C^{1/2}.

        Ŵ_q = B_q A_q, Ŵ_k = B_k A_k. C defaults to the undamped statistic given to the solver.
        """
        moment = self.second_moment if second_moment is None else second_moment.to(self.W_q)
        root, _ = symmetric_power(moment, 0.5)
        U = root @ self._heads(self.W_q, self.n_heads)
        V = root @ self._heads(self.W_k, self.n_kv_heads)
        P = root @ self._heads(B_q.to(self.W_q) @ A_q.to(self.W_q), self.n_heads)
        S = root @ self._heads(B_k.to(self.W_q) @ A_k.to(self.W_q), self.n_kv_heads)
        index, middles = self.group_index, self.middles
        total = factored_inner(U, U, V, V, index, middles)
        error = total - 2 * factored_inner(U, P, V, S, index, middles) + factored_inner(P, P, S, S, index, middles)
        return max(error, 0.0) / total if total > 0 else math.nan
