"""Rank choices from parameter budgets.

Stored weights of a rank-r factorization of a d' × d matrix (d = d_in, d' = d_out):

    plain      r (d + d')
    junction   r (d + d') − r²      (increasing in r for r ≤ (d + d')/2, hence on 1..min(d, d'))

A group of matrices W_j [d_j × s] sharing one input factor A [r × s] (shared_dim s) stores
r s (− r² with a junction) + r Σ_j d_j.
"""

from __future__ import annotations

from typing import Callable, Sequence

__all__ = [
    "factor_param_count",
    "rank_for_keep_fraction",
    "max_useful_rank",
    "check_useful_rank",
    "rank_for_group_budget",
    "group_param_count",
]


def factor_param_count(d_in: int, d_out: int, rank: int, junction: bool = True) -> int:
    """r (d_in + d_out) − r² with a junction, r (d_in + d_out) without."""
    return rank * (d_in + d_out) - (rank * rank if junction else 0)


def group_param_count(shared_dim: int, other_dims: Sequence[int], rank: int, junction: bool = True) -> int:
    """r · shared_dim (− r² with a junction) + r · Σ other_dims."""
    return rank * shared_dim - (rank * rank if junction else 0) + rank * sum(other_dims)


def _largest_rank_within(cost: Callable[[int], int], budget: float, max_rank: int) -> int:
    """Largest r in [1, max_rank] with cost(r) ≤ budget (cost increasing), 0 if none."""
    low, high = 0, max_rank  # invariant: cost(low) ≤ budget (cost(0) = 0), answer in [low, high]
    while low < high:
        middle = (low + high + 1) // 2
        if cost(middle) <= budget:
            low = middle
        else:
            high = middle - 1
    return low


def _check_dims(**dims: int) -> None:
    for name, value in dims.items():
        if int(value) < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def rank_for_keep_fraction(d_in: int, d_out: int, keep_fraction: float, junction: bool = True) -> int:
    """Largest r ≥ 1 whose stored weights are ≤ keep_fraction · d_in · d_out.

    Raises ``ValueError`` if keep_fraction ∉ (0, 1] or if even r = 1 exceeds the budget (the message
    gives the smallest keep_fraction that fits).
    """
    _check_dims(d_in=d_in, d_out=d_out)
    if not 0.0 < keep_fraction <= 1.0:
        raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
    dense = d_in * d_out
    budget = keep_fraction * dense
    rank = _largest_rank_within(
        lambda r: factor_param_count(d_in, d_out, r, junction), budget, min(d_in, d_out)
    )
    if rank < 1:
        smallest = factor_param_count(d_in, d_out, 1, junction) / dense
        raise ValueError(
            f"keep_fraction {keep_fraction} is below the rank-1 cost of a {d_out}x{d_in} matrix: "
            f"keep_fraction must be >= {smallest:.6g}"
        )
    return rank


def rank_for_ratio(d_in: int, d_out: int, ratio: float, junction: bool = True) -> int:
    """``rank_for_keep_fraction(d_in, d_out, 1 − ratio)`` for a compression ``ratio`` (the fraction removed); the
    error of an impossible ratio speaks of the ratio and gives the largest one the matrix allows."""
    try:
        return rank_for_keep_fraction(d_in, d_out, 1.0 - ratio, junction)
    except ValueError:
        if not 0.0 <= ratio < 1.0:
            raise ValueError(f"ratio must lie in (0, 1), got {ratio}") from None
        largest = 1.0 - factor_param_count(d_in, d_out, 1, junction) / (d_in * d_out)
        raise ValueError(f"ratio {ratio} (--ratio) removes more than a rank-1 factorization of this {d_out}x{d_in} "
                         f"matrix can: the largest ratio it allows is {largest:.6g}") from None


def max_useful_rank(d_in: int, d_out: int, junction: bool = True) -> int:
    """Largest r whose stored weights are strictly fewer than the dense d_in · d_out.

    Junction: min(d_in, d_out) − 1; plain: ⌈d_in d_out / (d_in + d_out)⌉ − 1. Raises ``ValueError`` if
    no rank saves parameters (e.g. a 1×n matrix).
    """
    _check_dims(d_in=d_in, d_out=d_out)
    dense = d_in * d_out
    rank = _largest_rank_within(
        lambda r: factor_param_count(d_in, d_out, r, junction), dense - 1, min(d_in, d_out)
    )
    if rank < 1:
        raise ValueError(f"no rank of a {d_out}x{d_in} matrix saves parameters (junction={junction})")
    return rank


def check_useful_rank(d_in: int, d_out: int, rank: int, junction: bool = True) -> None:
    """Raise ``ValueError`` (with the maximum) if ``rank`` cannot save parameters."""
    limit = max_useful_rank(d_in, d_out, junction)
    if not 1 <= rank <= limit:
        raise ValueError(
            f"rank {rank} does not save parameters for a {d_out}x{d_in} matrix (junction={junction}); "
            f"the maximum useful rank is {limit}"
        )


def rank_for_group_budget(
    shared_dim: int, other_dims: Sequence[int], budget: float, junction: bool = True
) -> int:
    """Largest r ≥ 1 with group_param_count(shared_dim, other_dims, r) ≤ budget (a parameter count).

    The rank is capped at min(shared_dim, Σ other_dims), the rank of the stacked matrices.
    """
    _check_dims(shared_dim=shared_dim)
    if len(other_dims) == 0:
        raise ValueError("other_dims must list at least one matrix")
    for index, dim in enumerate(other_dims):
        _check_dims(**{f"other_dims[{index}]": dim})
    max_rank = min(shared_dim, sum(other_dims))
    rank = _largest_rank_within(
        lambda r: group_param_count(shared_dim, other_dims, r, junction), budget, max_rank
    )
    if rank < 1:
        raise ValueError(
            f"budget {budget} is below the rank-1 cost {group_param_count(shared_dim, other_dims, 1, junction)} "
            f"of a group with shared dim {shared_dim} and dims {list(other_dims)}"
        )
    return rank
