"""Joint value/output compression (LatentLLM Sec. 4.2, the simple objective; Remark 11 says it may not
beat separate V/O compression — measure before defaulting to it).

Per query head i with value head g(i), whitening R = C^{1/2} of the damped second moment of the layer
input C [d, d], W_{v,g} [dh, d] (rows of v_proj), W_{o,i} [d_out, dh] (columns of o_proj):

    G_i = W_{o,i} W_{v,g(i)} R = L_i M_gᵀ,   L_i = W_{o,i} [d_out, dh],   M_g = R W_{v,g}ᵀ [d, dh]

Column-orthonormal output basis O = Lᵀ [d_out, r_o] and row-orthonormal input basis V [r_v, d] maximise
Σ_i ‖Oᵀ G_i Vᵀ‖² (alternating eigen-updates, linalg/tucker.py). Factors:

    A_v = V R⁻¹ [r_v, d]          shared input factor: the cached value latent is A_v x (r_v per token)
    B_v = W_v R Vᵀ [g·dh, r_v]    per value head decompression
    B_o = O [d_out, r_o]          shared output factor
    A_o = Oᵀ W_o [r_o, h·dh]      per head output cores (column blocks)

v_proj ≈ B_v A_v and o_proj ≈ B_o A_o, so Ŵ_{o,i} Ŵ_{v,g} R = O Oᵀ G_i Vᵀ V (the optimal Tucker core).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .joint_qk import gqa_group_index, whitening
from .preconditioners import symmetric_power
from .tucker import factored_inner, tucker2_factored

__all__ = ["JointVOFactors", "JointVOSolver"]


@dataclass
class JointVOFactors:
    """A_v [r_v, d], B_v [g·dh, r_v], B_o [d_out, r_o], A_o [r_o, h·dh] (float64) and the solver's log."""

    A_v: torch.Tensor
    B_v: torch.Tensor
    B_o: torch.Tensor
    A_o: torch.Tensor
    objective_history: list[float] = field(default_factory=list)
    total_energy: float = 0.0


class JointVOSolver:
    """Tucker-2 of the per-head value→output maps G_i = W_{o,i} W_{v,g(i)} C^{1/2}."""

    def __init__(
        self,
        W_v: torch.Tensor,
        W_o: torch.Tensor,
        second_moment: torch.Tensor,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        rank_v: int,
        rank_o: int,
        iterations: int = 8,
        damping: float = 1e-2,
        name: str = "attention",
    ):
        d = W_v.shape[1]
        if tuple(W_v.shape) != (n_kv_heads * head_dim, d) or W_o.shape[1] != n_heads * head_dim:
            raise ValueError(
                f"{name}: W_v {tuple(W_v.shape)} / W_o {tuple(W_o.shape)} do not match "
                f"{n_heads} heads, {n_kv_heads} kv heads of dim {head_dim}"
            )
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.rank_v, self.rank_o, self.iterations = rank_v, rank_o, iterations
        self.W_v = W_v.detach().to(torch.float64)
        self.W_o = W_o.detach().to(device=self.W_v.device, dtype=torch.float64)
        self.second_moment, self.root, self.root_inv = whitening(second_moment, d, damping, name, self.W_v.device)
        self.group_index = gqa_group_index(n_heads, n_kv_heads, device=self.W_v.device)

    def _output_heads(self, weight: torch.Tensor) -> torch.Tensor:
        """o_proj weight [d_out, h·dh] → per-head column blocks [h, d_out, dh]."""
        return weight.reshape(weight.shape[0], self.n_heads, self.head_dim).permute(1, 0, 2)

    def _value_heads(self, weight: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
        """v_proj weight [g·dh, d] → R W_{v,g}ᵀ [g, d, dh]."""
        return root @ weight.reshape(self.n_kv_heads, self.head_dim, -1).transpose(1, 2)

    def solve(self) -> JointVOFactors:
        lefts = self._output_heads(self.W_o)  # L_i [h, d_out, dh]
        rights = self._value_heads(self.W_v, self.root)  # M_g [g, d, dh]
        result = tucker2_factored(lefts, rights, self.group_index, self.rank_o, self.rank_v, self.iterations)
        output_basis, V = result.left, result.right  # Oᵀ [r_o, d_out], V [r_v, d]
        A_v = V @ self.root_inv
        B_v = self.W_v @ self.root @ V.T
        B_o = output_basis.T.contiguous()
        A_o = output_basis @ self.W_o
        return JointVOFactors(A_v, B_v, B_o, A_o, result.objective_history, result.total_energy)

    def map_error(
        self,
        A_v: torch.Tensor,
        B_v: torch.Tensor,
        B_o: torch.Tensor,
        A_o: torch.Tensor,
        second_moment: torch.Tensor | None = None,
    ) -> float:
        """Σ_i ‖(W_{o,i}W_{v,g} − Ŵ_{o,i}Ŵ_{v,g}) C^{1/2}‖² / Σ_i ‖W_{o,i}W_{v,g} C^{1/2}‖² (undamped C by default)."""
        moment = self.second_moment if second_moment is None else second_moment.to(self.W_v)
        root, _ = symmetric_power(moment, 0.5)
        L = self._output_heads(self.W_o)
        M = self._value_heads(self.W_v, root)
        L_hat = self._output_heads(B_o.to(self.W_v) @ A_o.to(self.W_v))
        M_hat = self._value_heads(B_v.to(self.W_v) @ A_v.to(self.W_v), root)
        index = self.group_index
        total = factored_inner(L, L, M, M, index)
        cross = factored_inner(L, L_hat, M, M_hat, index)
        error = total - 2 * cross + factored_inner(L_hat, L_hat, M_hat, M_hat, index)
        return max(error, 0.0) / total if total > 0 else math.nan
