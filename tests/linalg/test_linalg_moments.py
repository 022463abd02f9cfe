"""Streaming moment accumulator against direct float64 computation."""

import pytest
import torch

from retrofitter.linalg.moments import CrossMomentAccumulator, SecondMomentAccumulator, damped


def test_streaming_equals_direct_and_merge():
    generator = torch.Generator().manual_seed(0)
    data = torch.randn(3, 7, 5, generator=generator, dtype=torch.float64) + 0.5
    accumulator = SecondMomentAccumulator(5)
    accumulator.update(data[0].float())  # dtype of input does not matter beyond its precision
    other = SecondMomentAccumulator(5)
    other.update(data[1:])
    accumulator.merge(other)
    rows = torch.cat([data[0].float().double(), data[1:].reshape(-1, 5)])
    assert accumulator.count == 21
    torch.testing.assert_close(accumulator.mean, rows.mean(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(accumulator.second_moment, rows.T @ rows / 21, rtol=1e-12, atol=1e-12)
    centered = rows - rows.mean(0)
    torch.testing.assert_close(accumulator.covariance(), centered.T @ centered / 21, rtol=1e-10, atol=1e-12)


def test_zero_weight_rows_are_excluded_even_if_nan():
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]])
    x[mask == 0] = float("nan")  # padding garbage must not leak in
    accumulator = SecondMomentAccumulator(3)
    accumulator.update(x, weights=mask)
    kept = x[mask == 1]
    assert accumulator.count == 4
    torch.testing.assert_close(accumulator.second_moment, kept.T @ kept / 4)
    accumulator.check_finite("layers.0.q_proj")


def test_fractional_weights():
    x = torch.randn(6, 3, dtype=torch.float64)
    w = torch.rand(6, dtype=torch.float64)
    accumulator = SecondMomentAccumulator(3)
    accumulator.update(x, weights=w)
    torch.testing.assert_close(accumulator.mean, (w[:, None] * x).sum(0) / w.sum())
    torch.testing.assert_close(accumulator.second_moment, (x * w[:, None]).T @ x / w.sum())


def test_check_finite_names_the_layer():
    accumulator = SecondMomentAccumulator(2)
    accumulator.update(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="layers.3.mlp.down_proj"):
        accumulator.check_finite("layers.3.mlp.down_proj")


def test_errors_and_damping():
    accumulator = SecondMomentAccumulator(4)
    with pytest.raises(ValueError, match="empty"):
        _ = accumulator.mean
    with pytest.raises(ValueError, match="last dimension must be 4"):
        accumulator.update(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="weights shape"):
        accumulator.update(torch.zeros(2, 4), weights=torch.ones(3))
    matrix = torch.diag(torch.tensor([1.0, 3.0], dtype=torch.float64))
    torch.testing.assert_close(damped(matrix, 0.5), torch.diag(torch.tensor([2.0, 4.0], dtype=torch.float64)))
    torch.testing.assert_close(SecondMomentAccumulator.damped(torch.zeros(2, 2), 0.1), 0.1 * torch.eye(2))


def test_cross_moment():
    a = torch.randn(2, 5, 3, dtype=torch.float64)
    b = torch.randn(2, 5, 4, dtype=torch.float64)
    accumulator = CrossMomentAccumulator(3, 4)
    accumulator.update(a, b, weights=torch.ones(2, 5))
    torch.testing.assert_close(accumulator.cross_moment, a.reshape(-1, 3).T @ b.reshape(-1, 4) / 10)
