"""Teacher-target fit = reduced-rank regression of the teacher's outputs on the compressed inputs (float64)."""

import torch

from retrofitter.linalg.teacher_target import teacher_target_factors, teacher_target_map


def _data(seed=0, d=12, d_out=9, n=400):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d_out, d, generator=g, dtype=torch.float64)
    X_t = torch.randn(d, n, generator=g, dtype=torch.float64) * torch.linspace(0.2, 3, d, dtype=torch.float64)[:, None]
    X_c = X_t + 0.3 * torch.randn(d, n, generator=g, dtype=torch.float64)  # what the compressed layers produce
    return W, X_t, X_c


def test_unconstrained_map_equals_least_squares():
    W, X_t, X_c = _data()
    n = X_t.shape[1]
    W_tilde = teacher_target_map(W, X_t @ X_c.T / n, X_c @ X_c.T / n, damping=0.0)
    brute = torch.linalg.lstsq(X_c.T, (W @ X_t).T).solution.T  # min ‖W X_t − W′ X_c‖ over all W′
    torch.testing.assert_close(W_tilde, brute, rtol=1e-9, atol=1e-9)


def test_rank_r_fit_equals_reduced_rank_regression_and_beats_every_other_rank_r_map():
    W, X_t, X_c = _data(seed=1)
    n, r = X_t.shape[1], 4
    B, A = teacher_target_factors(W, X_t @ X_c.T / n, X_c @ X_c.T / n, r, damping=0.0)
    # Reduced-rank regression, computed another way: project the fitted values on their top-r directions.
    W_tilde = torch.linalg.lstsq(X_c.T, (W @ X_t).T).solution.T
    U, _, _ = torch.linalg.svd(W_tilde @ X_c, full_matrices=False)
    rrr = U[:, :r] @ U[:, :r].T @ W_tilde
    torch.testing.assert_close(B @ A, rrr, rtol=1e-8, atol=1e-8)

    def loss(M):
        return float((W @ X_t - M @ X_c).pow(2).sum())

    g = torch.Generator().manual_seed(2)
    for _ in range(20):  # random rank-r perturbations never do better
        perturbed = (B + 1e-3 * torch.randn(B.shape, generator=g, dtype=B.dtype)) @ (
            A + 1e-3 * torch.randn(A.shape, generator=g, dtype=A.dtype))
        assert loss(B @ A) <= loss(perturbed) + 1e-9
    # the fit to the compressed model's own outputs (today's rootcov fit) is worse on the teacher target
    B_own, A_own = teacher_target_factors(W, X_c @ X_c.T / n, X_c @ X_c.T / n, r, damping=0.0)
    assert loss(B @ A) < loss(B_own @ A_own)


def test_identical_streams_give_the_plain_fit():
    W, _, X_c = _data(seed=3)
    n = X_c.shape[1]
    C = X_c @ X_c.T / n
    B, A = teacher_target_factors(W, C, C, 5, damping=0.0)
    from retrofitter.linalg.svd import rootcov_svd

    B0, A0 = rootcov_svd(W, C, 5, damping=0.0)
    torch.testing.assert_close(B @ A, B0 @ A0, rtol=1e-8, atol=1e-8)
