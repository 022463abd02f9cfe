"""Streaming moment accumulator against direct float64 computation."""

import pytest
import torch

from retrofitter.linalg.moments import CrossMomentAccumulator, SecondMomentAccumulator, damped, symmetric_gram


def test_streaming_equals_direct_and_merge():
    generator = torch.Generator().manual_seed(0)
    data = torch.randn(3, 7, 5, generator=generator, dtype=torch.float64) + 0.5
    accumulator = SecondMomentAccumulator(5, product_dtype=torch.float64)
    accumulator.update(data[0].float())  # float64 products: the input's dtype does not matter beyond its precision
    other = SecondMomentAccumulator(5)  # float64 rows: float64 products by default
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float32_products_match_the_float64_reference(dtype):
    """The default (each batch's XᵀX in float32, summed in float64) against float64 products, on rows with
    a 1e3 dynamic range across channels (outlier features) and a large batch: relative error ≲ 1e-6."""
    generator = torch.Generator().manual_seed(1)
    scales = torch.logspace(-1.5, 1.5, 48, dtype=torch.float64)
    batches = [(torch.randn(4096, 48, generator=generator, dtype=torch.float64) * scales + 0.3).to(dtype)
               for _ in range(3)]
    weights = (torch.rand(4096, generator=generator) > 0.2).float()
    fast, reference = SecondMomentAccumulator(48), SecondMomentAccumulator(48, product_dtype=torch.float64)
    cross_fast = CrossMomentAccumulator(48, 48)
    cross_reference = CrossMomentAccumulator(48, 48, product_dtype=torch.float64)
    for x in batches:
        for accumulator in (fast, reference):
            accumulator.update(x, weights=weights)
        for accumulator in (cross_fast, cross_reference):
            accumulator.update(x, x.flip(-1))
    assert fast.count == reference.count
    for got, want in ((fast.second_moment, reference.second_moment), (fast.mean, reference.mean),
                      (cross_fast.cross_moment, cross_reference.cross_moment)):
        assert got.dtype == torch.float64
        assert float((got - want).norm() / want.norm()) < 2e-6
    # each entry to its own scale: the small channels are not drowned by the large ones
    diagonal = torch.diagonal(reference.second_moment)
    assert float(((torch.diagonal(fast.second_moment) - diagonal) / diagonal).abs().max()) < 1e-5
    with pytest.raises(ValueError, match="product_dtype"):
        SecondMomentAccumulator(3, product_dtype=torch.float16)


@pytest.mark.parametrize("d, blocks", [(300, 4), (257, 3), (100, 4), (512, 1)])
def test_symmetric_gram_equals_one_gemm_and_is_exactly_symmetric(d, blocks):
    rows = torch.randn(700, d, generator=torch.Generator().manual_seed(d), dtype=torch.float64)
    gram = symmetric_gram(rows, blocks)
    torch.testing.assert_close(gram, rows.T @ rows, rtol=1e-12, atol=1e-10)
    # exact by construction (each diagonal block, and the one-GEMM path, mirrors its lower triangle): a GEMM's
    # (i, j) and (j, i) entries need not be summed in the same order (MKL on AMD EPYC: ~1e-14 apart)
    assert torch.equal(gram, gram.T)
