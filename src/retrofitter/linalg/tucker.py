"""Tucker-2 (two-mode HOSVD) of a set of factored matrices, by alternating eigen-updates.

Terms: for head i (i = 0..h−1) with partner g = right_index[i] and optional "middle" matrices
R_δ [k, k] (δ = 0..D−1; RoPE relative rotations, identity when absent):

    G_{i,δ} = U_i R_δ V_gᵀ,     U_i [m, k] (left mode),   V_g [n, k] (right mode)

Find row-orthonormal L [r_l, m], R [r_r, n] maximising  Σ_{i,δ} ‖L G_{i,δ} Rᵀ‖²  (equivalently
minimising Σ ‖G − Lᵀ(L G Rᵀ)R‖², the optimal core being L G Rᵀ):

    R ← TopEigRows_{r_r}( Σ_{i,δ} G_{i,δ}ᵀ LᵀL G_{i,δ} ),   L ← TopEigRows_{r_l}( Σ_{i,δ} G_{i,δ} RᵀR G_{i,δ}ᵀ )

Every product is formed through the thin factors (k×k "Gram" cores): O(h·(m + n)·k·r) per step and
one m×m / n×n accumulated matrix; the h m×n matrices G are never built. Each half-step solves its
conditional problem exactly, so the objective never decreases.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = [
    "Tucker2Result",
    "top_eigen_rows",
    "factored_inner",
    "tucker2_factored",
]


def top_eigen_rows(matrix: torch.Tensor, rank: int) -> torch.Tensor:
    """Leading ``rank`` eigenvectors of a symmetric matrix [n, n] as rows [rank, n] (largest first)."""
    symmetric = (matrix + matrix.T) / 2
    _, eigenvectors = torch.linalg.eigh(symmetric)  # ascending eigenvalues
    return eigenvectors[:, -rank:].flip(-1).T.contiguous()


def _sandwich(core: torch.Tensor, middles: torch.Tensor | None, transpose_outer: bool) -> torch.Tensor:
    """Σ_δ R_δᵀ core R_δ (transpose_outer=True) or Σ_δ R_δ core R_δᵀ, batched over core [T, k, k]."""
    if middles is None:
        return core
    if transpose_outer:
        return torch.einsum("dba,tbc,dce->tae", middles, core, middles)
    return torch.einsum("dab,tbc,dec->tae", middles, core, middles)


def factored_inner(
    lefts_a: torch.Tensor,
    lefts_b: torch.Tensor,
    rights_a: torch.Tensor,
    rights_b: torch.Tensor,
    right_index: torch.Tensor,
    middles: torch.Tensor | None = None,
) -> float:
    """Σ_{i,δ} ⟨U_i R_δ V_gᵀ, P_i R_δ S_gᵀ⟩; U = lefts_a, P = lefts_b [h, m, k]; V = rights_a, S = rights_b [g, n, k].

    Uses ⟨U R Vᵀ, P R Sᵀ⟩ = Σ (Rᵀ (UᵀP) R) ∘ (VᵀS): only k×k products.
    """
    left_cores = _sandwich(lefts_a.transpose(1, 2) @ lefts_b, middles, transpose_outer=True)  # [h, k, k]
    right_cores = (rights_a.transpose(1, 2) @ rights_b)[right_index]  # [h, k, k]
    return float((left_cores * right_cores).sum())


@dataclass
class Tucker2Result:
    """left [r_l, m], right [r_r, n] (row-orthonormal); objective after each half-step; total Σ‖G‖²."""

    left: torch.Tensor
    right: torch.Tensor
    objective_history: list[float] = field(default_factory=list)
    total_energy: float = 0.0


def _left_gram(lefts, rights, right_index, right_basis, middles):
    """Σ_{i,δ} G RᵀR Gᵀ = Σ_i U_i [Σ_δ R_δ (b_gᵀ b_g) R_δᵀ] U_iᵀ with b_g = R V_g (R = I if None)."""
    projected = rights if right_basis is None else right_basis @ rights  # [g, r or n, k]
    cores = (projected.transpose(1, 2) @ projected)[right_index]  # [h, k, k]
    cores = _sandwich(cores, middles, transpose_outer=False)
    return torch.einsum("tak,tkl,tbl->ab", lefts, cores, lefts)  # [m, m]


def _right_gram(lefts, rights, right_index, left_basis, n_rights, middles):
    """Σ_{i,δ} Gᵀ LᵀL G = Σ_g V_g [Σ_{i→g} Σ_δ R_δᵀ (a_iᵀ a_i) R_δ] V_gᵀ with a_i = L U_i."""
    projected = left_basis @ lefts  # [h, r_l, k]
    cores = _sandwich(projected.transpose(1, 2) @ projected, middles, transpose_outer=True)  # [h, k, k]
    per_right = torch.zeros(n_rights, *cores.shape[1:], dtype=cores.dtype, device=cores.device)
    per_right.index_add_(0, right_index, cores)  # heads sharing one right factor (GQA) are summed
    return torch.einsum("gak,gkl,gbl->ab", rights, per_right, rights)  # [n, n]


def tucker2_factored(
    lefts: torch.Tensor,
    rights: torch.Tensor,
    right_index: torch.Tensor,
    rank_left: int,
    rank_right: int,
    iterations: int = 8,
    middles: torch.Tensor | None = None,
) -> Tucker2Result:
    """Alternating Tucker-2 of G_{i,δ} = U_i R_δ V_{right_index[i]}ᵀ (float64).

    lefts [h, m, k], rights [g, n, k], right_index [h] long in [0, g), middles [D, k, k] or None.
    L is initialised from the top eigenvectors of Σ G Gᵀ; then ``iterations`` rounds of (R, L) updates.
    """
    h, m, k = lefts.shape
    n_rights, n, k_right = rights.shape
    if k_right != k or right_index.shape != (h,):
        raise ValueError(
            f"shape mismatch: lefts {tuple(lefts.shape)}, rights {tuple(rights.shape)}, "
            f"right_index {tuple(right_index.shape)}"
        )
    if not 1 <= rank_left <= m or not 1 <= rank_right <= n:
        raise ValueError(f"ranks must be in [1, {m}] and [1, {n}], got {rank_left} and {rank_right}")
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    lefts, rights = lefts.to(torch.float64), rights.to(torch.float64)
    middles = middles.to(torch.float64) if middles is not None else None
    right_index = right_index.to(device=lefts.device, dtype=torch.long)

    def objective(left_basis, right_basis):
        a = left_basis @ lefts
        b = right_basis @ rights
        return factored_inner(a, a, b, b, right_index, middles)

    total = factored_inner(lefts, lefts, rights, rights, right_index, middles)
    left_basis = top_eigen_rows(_left_gram(lefts, rights, right_index, None, middles), rank_left)
    history: list[float] = []
    right_basis = None
    for _ in range(iterations):
        right_basis = top_eigen_rows(
            _right_gram(lefts, rights, right_index, left_basis, n_rights, middles), rank_right
        )
        history.append(objective(left_basis, right_basis))
        left_basis = top_eigen_rows(_left_gram(lefts, rights, right_index, right_basis, middles), rank_left)
        history.append(objective(left_basis, right_basis))
    return Tucker2Result(left=left_basis, right=right_basis, objective_history=history, total_energy=total)
