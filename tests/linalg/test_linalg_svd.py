"""Weighted low-rank SVD: optimality of rootcov, equivalences, bias compensation, proxy error."""

import pytest
import torch

from retrofitter.linalg.preconditioners import PRECONDITIONERS, make_preconditioner
from retrofitter.linalg.svd import (bias_compensation, cheapest_weighted_svd, output_side_svd, proxy_error, rootcov_svd, uses_output_side,
                                    weighted_low_rank, weighted_svd)
from retrofitter.linalg.svd import build_preconditioner


def _problem(seed=0, d_out=6, d_in=5, tokens=12):
    generator = torch.Generator().manual_seed(seed)
    W = torch.randn(d_out, d_in, generator=generator, dtype=torch.float64)
    mixing = torch.randn(d_in, d_in, generator=generator, dtype=torch.float64)
    scales = torch.tensor([4.0, 2.0, 1.0, 0.3, 0.1], dtype=torch.float64)[:d_in]
    X = mixing @ torch.diag(scales) @ torch.randn(d_in, tokens, generator=generator, dtype=torch.float64)
    return W, X


def _activation_error(W, B, A, X):
    return float(((W - B @ A) @ X).pow(2).sum())


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_rootcov_attains_eckart_young_bound_and_beats_other_preconditioners(rank):
    W, X = _problem(seed=rank)
    C = X @ X.T / X.shape[1]
    B, A = weighted_low_rank(W, C, rank, "rootcov", damping=0.0)
    # Independent optimum: any rank-r Ŵ gives rank-r ŴX, so the error is ≥ the SVD tail of WX,
    # and Ŵ = U_r U_rᵀ W (project onto the top-r left singular space of WX) attains it.
    U, S, _ = torch.linalg.svd(W @ X, full_matrices=False)
    tail = float(S[rank:].pow(2).sum())
    best = U[:, :rank] @ U[:, :rank].T @ W
    error = _activation_error(W, B, A, X)
    assert error == pytest.approx(tail, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(B @ A, best, rtol=1e-8, atol=1e-10)
    for name in PRECONDITIONERS:
        B_other, A_other = weighted_low_rank(W, C, rank, name, damping=0.0)
        assert _activation_error(W, B_other, A_other, X) >= error * (1 - 1e-9), name
    # The ordering is strict for the badly matched preconditioners on this data.
    B_plain, A_plain = weighted_low_rank(W, C, rank, "plain", damping=0.0)
    assert _activation_error(W, B_plain, A_plain, X) > error * 1.01


def test_cholesky_matches_rootcov_product():
    W, X = _problem(seed=5)
    C = X @ X.T / X.shape[1]
    B_root, A_root = rootcov_svd(W, C, 3, damping=1e-3)
    B_chol, A_chol = weighted_low_rank(W, C, 3, "cholesky", damping=1e-3)
    torch.testing.assert_close(B_chol @ A_chol, B_root @ A_root, rtol=1e-8, atol=1e-10)


def test_rootcov_optimal_with_rank_deficient_statistics():
    W, X = _problem(seed=7, tokens=3)  # C has rank 3 < d = 5: the pseudo-inverse path
    C = X @ X.T / X.shape[1]
    B, A = weighted_low_rank(W, C, 2, "rootcov", damping=0.0)
    S = torch.linalg.svdvals(W @ X)
    assert _activation_error(W, B, A, X) == pytest.approx(float(S[2:].pow(2).sum()), rel=1e-8, abs=1e-10)


def test_plain_on_identity_is_truncated_svd():
    W, _ = _problem(seed=2)
    U, S, Vh = torch.linalg.svd(W, full_matrices=False)
    truncated = U[:, :2] * S[:2] @ Vh[:2]
    for moment in (None, torch.eye(5, dtype=torch.float64)):
        B, A = weighted_low_rank(W, moment, 2, "plain")
        torch.testing.assert_close(B @ A, truncated, rtol=1e-10, atol=1e-12)
    B, A = weighted_low_rank(W, torch.eye(5, dtype=torch.float64), 2, "rootcov", damping=0.0)
    torch.testing.assert_close(B @ A, truncated, rtol=1e-10, atol=1e-12)


def test_pseudo_inverses_are_exact():
    _, X = _problem(seed=3)
    C = X @ X.T / X.shape[1]
    for name in PRECONDITIONERS:
        pre = make_preconditioner(name, C)
        torch.testing.assert_close(pre.P @ pre.P_inv, torch.eye(5, dtype=torch.float64), atol=1e-8, rtol=0)
    root = make_preconditioner("rootcov", C)
    torch.testing.assert_close(root.P @ root.P, C, rtol=1e-10, atol=1e-12)
    chol = make_preconditioner("cholesky", C)
    torch.testing.assert_close(chol.P @ chol.P.T, C, rtol=1e-10, atol=1e-12)


def test_full_rank_is_exact_and_errors_are_clear():
    W, X = _problem()
    B, A = weighted_low_rank(W, X @ X.T, 5)
    torch.testing.assert_close(B @ A, W, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match=r"unknown preconditioner 'svd'.*rootcov"):
        weighted_low_rank(W, X @ X.T, 2, "svd")
    with pytest.raises(ValueError, match=r"rank must be in \[1, 5\]"):
        weighted_low_rank(W, X @ X.T, 6)
    with pytest.raises(ValueError, match="does not match"):
        weighted_low_rank(W, torch.eye(4), 2)
    bad = X @ X.T
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"layers.2.self_attn.k_proj \(second moment\)"):
        weighted_low_rank(W, bad, 2, name="layers.2.self_attn.k_proj")


def test_bias_compensation_reduces_error_with_nonzero_mean():
    W, X = _problem(seed=4, tokens=40)
    X = X + torch.tensor([3.0, -2.0, 1.0, 0.5, 4.0], dtype=torch.float64)[:, None]
    bias = torch.randn(6, dtype=torch.float64)
    tokens = X.shape[1]
    mean = X.mean(1)
    C = X @ X.T / tokens
    target = W @ X + bias[:, None]
    # Without compensation: fit on the uncentered moment, keep the bias.
    B0, A0 = weighted_low_rank(W, C, 2, damping=0.0)
    error_plain = float((B0 @ A0 @ X + bias[:, None] - target).pow(2).sum())
    # With compensation: fit on the centered moment, shift the bias.
    B1, A1 = weighted_low_rank(W, C - torch.outer(mean, mean), 2, damping=0.0)
    new_bias = bias_compensation(W, B1, A1, bias, mean)
    error_comp = float((B1 @ A1 @ X + new_bias[:, None] - target).pow(2).sum())
    assert error_comp < 0.9 * error_plain
    torch.testing.assert_close(bias_compensation(W, B1, A1, None, mean) + bias, new_bias)
    # The compensated layer has the original mean output.
    torch.testing.assert_close((B1 @ A1 @ X + new_bias[:, None]).mean(1), target.mean(1))


def test_proxy_error_is_relative_activation_error():
    W, X = _problem(seed=6)
    C = X @ X.T / X.shape[1]
    B, A = weighted_low_rank(W, C, 2, damping=0.0)
    expected = float(((W - B @ A) @ X).pow(2).sum() / (W @ X).pow(2).sum())
    assert proxy_error(W, B, A, C) == pytest.approx(expected, rel=1e-10)
    assert proxy_error(W, torch.zeros(6, 1), torch.zeros(1, 5), C) == pytest.approx(1.0)


@pytest.mark.parametrize("d_out, d_in, rank_of_w", [(4, 9, 4), (6, 10, 3), (9, 9, 9)])
def test_output_side_svd_equals_the_input_side_fit(d_out, d_in, rank_of_w):
    """U_r U_rᵀ W from the eigenvectors of W C_λ Wᵀ is the rootcov optimum of every rank (float64), also
    for a rank-deficient W, with the same spectrum and the same factors up to each component's sign."""
    generator = torch.Generator().manual_seed(d_out * d_in + rank_of_w)
    W = (torch.randn(d_out, rank_of_w, generator=generator, dtype=torch.float64)
         @ torch.randn(rank_of_w, d_in, generator=generator, dtype=torch.float64))
    X = torch.randn(d_in, 40, generator=generator, dtype=torch.float64) * torch.linspace(0.1, 3, d_in)[:, None]
    C = X @ X.T / X.shape[1]
    fast, reference = output_side_svd(W, C, damping=0.05), weighted_svd(W, C, "rootcov", damping=0.05)
    torch.testing.assert_close(fast.S, reference.S, rtol=1e-9, atol=1e-7 * float(reference.S[0]))
    for rank in range(1, min(d_out, d_in) + 1):
        (B, A), (B_ref, A_ref) = fast.factors(rank), reference.factors(rank)
        if rank <= rank_of_w:
            torch.testing.assert_close(B @ A, B_ref @ A_ref, rtol=1e-8, atol=1e-9)
            signs = torch.sign((B * B_ref).sum(0))  # each component up to its sign
            torch.testing.assert_close(B * signs, B_ref, rtol=1e-7, atol=1e-8)
        else:  # beyond W's rank nothing is left to fit: both reproduce W
            torch.testing.assert_close(B @ A, W, rtol=1e-8, atol=1e-9)
    assert uses_output_side(d_out, d_in, "rootcov", 0.01) == (d_out < d_in)
    assert not uses_output_side(4, 9, "rootcov", 0.0) and not uses_output_side(4, 9, "cov", 0.01)
    with pytest.raises(ValueError, match="damping > 0"):
        output_side_svd(W, C, damping=0.0)


def test_cheapest_weighted_svd_builds_the_input_preconditioner_only_when_it_is_the_route():
    generator = torch.Generator().manual_seed(11)
    X = torch.randn(8, 50, generator=generator, dtype=torch.float64)
    C = X @ X.T / X.shape[1]
    calls = []

    def shared():
        calls.append(1)
        return build_preconditioner(C, 8, "rootcov", 0.01)

    wide_out, wide_in = (torch.randn(*shape, generator=generator, dtype=torch.float64) for shape in ((12, 8), (3, 8)))
    for W, expected_calls in ((wide_in, 0), (wide_out, 1)):  # d' < d: output side, no P; d' > d: W P
        svd = cheapest_weighted_svd(W, C, "rootcov", 0.01, shared)
        assert len(calls) == expected_calls
        reference = weighted_svd(W, C, "rootcov", damping=0.01)
        B, A = svd.factors(2)
        B_ref, A_ref = reference.factors(2)
        torch.testing.assert_close(B @ A, B_ref @ A_ref, rtol=1e-8, atol=1e-10)
