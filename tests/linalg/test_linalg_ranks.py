"""Rank choices from parameter budgets."""

import pytest

from retrofitter.linalg.ranks import (
    check_useful_rank,
    factor_param_count,
    group_param_count,
    max_useful_rank,
    rank_for_group_budget,
    rank_for_keep_fraction,
)


def _brute_force(d_in, d_out, keep, junction):
    budget = keep * d_in * d_out
    fitting = [r for r in range(1, min(d_in, d_out) + 1) if factor_param_count(d_in, d_out, r, junction) <= budget]
    return max(fitting) if fitting else None


def test_keep_fraction_examples():
    # Square 576: 75% keep with a junction → r with 2·576·r − r² ≤ 0.75·576² → r = 288 (ρ = 1/2 row of the slides).
    assert rank_for_keep_fraction(576, 576, 0.75, junction=True) == 288
    assert rank_for_keep_fraction(576, 576, 0.75, junction=False) == 216
    assert rank_for_keep_fraction(576, 576, 1.0, junction=True) == 576
    assert rank_for_keep_fraction(576, 1536, 0.5, junction=False) == 209  # ⌊0.5·576·1536/2112⌋
    for d_in, d_out in [(7, 3), (10, 10), (13, 29)]:
        for keep in (0.2, 0.5, 0.8, 1.0):
            for junction in (True, False):
                expected = _brute_force(d_in, d_out, keep, junction)
                if expected is None:
                    with pytest.raises(ValueError, match="keep_fraction must be >="):
                        rank_for_keep_fraction(d_in, d_out, keep, junction)
                else:
                    assert rank_for_keep_fraction(d_in, d_out, keep, junction) == expected


def test_keep_fraction_errors():
    with pytest.raises(ValueError, match=r"keep_fraction must be in \(0, 1\]"):
        rank_for_keep_fraction(8, 8, 0.0)
    with pytest.raises(ValueError, match=r"keep_fraction must be in \(0, 1\]"):
        rank_for_keep_fraction(8, 8, 1.5)
    with pytest.raises(ValueError, match=r"must be >= 0.234375"):  # (8 + 8 − 1)/64
        rank_for_keep_fraction(8, 8, 0.1)


def test_max_useful_rank():
    assert max_useful_rank(10, 6, junction=True) == 5
    assert max_useful_rank(10, 6, junction=False) == 3  # 3·16 = 48 < 60, 4·16 = 64 ≥ 60
    assert max_useful_rank(4, 4, junction=False) == 1  # 2·8 = 16 is not < 16
    with pytest.raises(ValueError, match="no rank"):
        max_useful_rank(1, 5)
    with pytest.raises(ValueError, match="maximum useful rank is 5"):
        check_useful_rank(10, 6, 6, junction=True)
    check_useful_rank(10, 6, 5, junction=True)


def test_group_budget():
    # Shared A [r × 16], outputs of 8 and 4 rows.
    for junction in (True, False):
        for budget in (40, 100, 150, 190):
            rank = rank_for_group_budget(16, [8, 4], budget, junction)
            assert group_param_count(16, [8, 4], rank, junction) <= budget
            if rank < 12:
                assert group_param_count(16, [8, 4], rank + 1, junction) > budget
    assert rank_for_group_budget(16, [8, 4], 10**6) == 12  # capped by the stacked rank
    with pytest.raises(ValueError, match="rank-1 cost 27"):
        rank_for_group_budget(16, [8, 4], 20, junction=True)
