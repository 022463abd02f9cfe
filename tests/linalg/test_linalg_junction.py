"""Junction factorization keeps B A exactly with r(d + d') − r² stored numbers."""

import pytest
import torch

from retrofitter.linalg.junction import (
    assemble_down,
    junction_factor,
    junction_param_count,
    pivoted_columns,
)


@pytest.mark.parametrize("shape", [(7, 3, 9), (4, 4, 4), (5, 1, 6), (9, 5, 5)])
def test_junction_keeps_product(shape):
    d_out, rank, d_in = shape
    generator = torch.Generator().manual_seed(sum(shape))
    B = torch.randn(d_out, rank, generator=generator, dtype=torch.float64)
    A = torch.randn(rank, d_in, generator=generator, dtype=torch.float64)
    factors = junction_factor(B, A)
    torch.testing.assert_close(factors.dense(), B @ A, rtol=0, atol=1e-10)
    down = factors.down()
    torch.testing.assert_close(down[:, factors.pivot_index], torch.eye(rank, dtype=torch.float64))
    assert sorted(torch.cat([factors.pivot_index, factors.rest_index]).tolist()) == list(range(d_in))
    assert factors.pivot_index.dtype == torch.long and factors.rest_index.dtype == torch.long
    stored = factors.up.numel() + factors.mix.numel()
    assert stored == junction_param_count(d_in, d_out, rank) == rank * (d_in + d_out) - rank**2
    assert factors.condition >= 1.0


def test_pivoting_picks_well_conditioned_columns():
    # Columns 0 and 1 are nearly parallel; greedy QRCP must not pick both.
    A = torch.tensor([[1.0, 1.0, 0.0, 0.1], [0.0, 1e-9, 1.0, 0.1]], dtype=torch.float64)
    pivots = pivoted_columns(A)
    assert set(pivots.tolist()) in ({0, 2}, {1, 2})
    assert junction_factor(torch.ones(3, 2, dtype=torch.float64), A).condition < 10


def test_ill_conditioned_junction_raises():
    A = torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0 + 1e-12]], dtype=torch.float64)
    with pytest.raises(ValueError, match="ill-conditioned.*junction=False"):
        junction_factor(torch.ones(2, 2, dtype=torch.float64), A)
    factors = junction_factor(torch.ones(2, 2, dtype=torch.float64), A, max_condition=None)
    assert factors.condition > 1e8


def test_assemble_down_and_shape_errors():
    mix = torch.tensor([[5.0], [6.0]])
    down = assemble_down(mix, torch.tensor([2, 0]), torch.tensor([1]))
    torch.testing.assert_close(down, torch.tensor([[0.0, 5.0, 1.0], [1.0, 6.0, 0.0]]))
    with pytest.raises(ValueError, match="share r"):
        junction_factor(torch.ones(3, 2), torch.ones(3, 4))
    with pytest.raises(ValueError, match="rank <= input dim"):
        pivoted_columns(torch.ones(4, 3))


@pytest.mark.parametrize("rank, width", [(5, 12), (40, 96), (120, 200)])
def test_fast_pivoting_is_as_well_conditioned_as_greedy_reference(rank, width):
    from retrofitter.linalg.junction import greedy_pivoted_columns

    generator = torch.Generator().manual_seed(rank)
    # rows of an orthonormal basis with a decaying column scale: a hard but realistic A = V P⁻¹
    basis = torch.linalg.qr(torch.randn(width, rank, dtype=torch.float64, generator=generator))[0].T
    A = basis @ torch.diag(torch.logspace(0, -4, width, dtype=torch.float64))
    fast, reference = pivoted_columns(A), greedy_pivoted_columns(A)
    assert len(set(fast.tolist())) == rank
    cond_fast = float(torch.linalg.cond(A[:, fast]))
    cond_reference = float(torch.linalg.cond(A[:, reference]))
    assert cond_fast <= 10 * cond_reference
