"""Joint MLP compression: streaming down refit and auxiliary-variable iterations beat local SVD."""

import pytest
import torch

from retrofitter.linalg.joint_mlp import (
    ACTIVATIONS,
    down_fit_error,
    fit_down_to_compressed,
    joint_gated_mlp,
    joint_mlp_relu,
)
from retrofitter.linalg.svd import weighted_low_rank


def _mlp(seed=0, d=10, m=24, tokens=240):
    generator = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    X = randn(d, d) @ randn(d, tokens) + 0.3
    W_u = randn(m, d) * torch.logspace(0, -1, d, dtype=torch.float64)
    return X, randn(m, d), W_u, randn(d, m)


def test_streaming_down_fit_matches_explicit_least_squares_and_beats_local():
    X, W_g, W_u, W_d = _mlp()
    tokens = X.shape[1]
    h = torch.nn.functional.silu(W_g @ X) * (W_u @ X)  # original intermediate [m, l]
    B_g, A_g = weighted_low_rank(W_g, X @ X.T / tokens, 5, damping=1e-8)
    B_u, A_u = weighted_low_rank(W_u, X @ X.T / tokens, 5, damping=1e-8)
    h_hat = torch.nn.functional.silu(B_g @ A_g @ X) * (B_u @ A_u @ X)  # compressed intermediate
    streaming = {}
    for anchored in (True, False):  # the two damping forms agree without damping
        B, A = fit_down_to_compressed(W_d, h @ h_hat.T / tokens, h_hat @ h_hat.T / tokens, 6, damping=1e-10,
                                      anchored=anchored)
        streaming[anchored] = float((B @ A @ h_hat - W_d @ h).pow(2).sum())
    assert streaming[True] == pytest.approx(streaming[False], rel=1e-6)
    streaming = streaming[True]
    # Reference: brute-force rank-6 least squares min ‖W_d h − Ŵ ĥ‖ = SVD tail of the projected target.
    target = W_d @ h
    Q, _ = torch.linalg.qr(h_hat.T)  # orthonormal basis of ĥ's row space [l, m]
    projected = target @ Q
    S = torch.linalg.svdvals(projected)
    optimum = float(target.pow(2).sum() - projected.pow(2).sum() + S[6:].pow(2).sum())
    assert streaming == pytest.approx(optimum, rel=1e-6)
    B_local, A_local = weighted_low_rank(W_d, h @ h.T / tokens, 6, damping=1e-8)
    local = float((B_local @ A_local @ h_hat - target).pow(2).sum())
    assert streaming < local


def test_anchored_damping_keeps_the_original_map_when_the_intermediate_is_exact():
    """ĥ = h: the anchored fit is the plain rootcov fit of W_d whatever the damping; the ridge-to-zero one shrinks."""
    X, W_g, W_u, W_d = _mlp(seed=3)
    h = torch.nn.functional.silu(W_g @ X) * (W_u @ X)
    moment = h @ h.T / h.shape[1]
    full = min(W_d.shape)
    B, A = fit_down_to_compressed(W_d, moment, moment, full, damping=0.5, anchored=True)
    assert torch.allclose(B @ A, W_d, atol=1e-9)
    B, A = fit_down_to_compressed(W_d, moment, moment, full, damping=0.5, anchored=False)
    assert not torch.allclose(B @ A, W_d, atol=1e-3)


def test_down_fit_error_equals_the_error_on_the_tokens():
    X, W_g, W_u, W_d = _mlp(seed=4)
    tokens = X.shape[1]
    h = torch.nn.functional.silu(W_g @ X) * (W_u @ X)
    h_hat = h + 0.1 * torch.randn(h.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    B, A = torch.randn(W_d.shape[0], 4, dtype=torch.float64), torch.randn(4, W_d.shape[1], dtype=torch.float64)
    direct = float((W_d @ h - B @ A @ h_hat).pow(2).sum() / (W_d @ h).pow(2).sum())
    from_moments = down_fit_error(W_d, B, A, h @ h.T / tokens, h @ h_hat.T / tokens, h_hat @ h_hat.T / tokens)
    assert from_moments == pytest.approx(direct, rel=1e-10)


def test_relu_joint_beats_local_and_streaming():
    X, _, W_u, W_d = _mlp(seed=1)
    result = joint_mlp_relu(W_u, W_d, X, 5, 5, iterations=4, damping=1e-6)
    local = result.output_errors[0]
    best = result.output_errors[result.best_iteration]
    assert len(result.output_errors) == 5 and result.best_iteration > 0
    assert best < result.streaming_error < local
    B_u, A_u = result.factors["up"]
    B_d, A_d = result.factors["down"]
    assert B_u.shape == (24, 5) and A_d.shape == (5, 24)
    output = B_d @ A_d @ torch.relu(B_u @ A_u @ X)
    target = W_d @ torch.relu(W_u @ X)
    assert float((output - target).pow(2).sum() / target.pow(2).sum()) == pytest.approx(best, rel=1e-8)


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_gated_joint_beats_local(activation):
    X, W_g, W_u, W_d = _mlp(seed=2)
    result = joint_gated_mlp(W_g, W_u, W_d, X, 5, 5, 5, activation=activation, iterations=3, damping=1e-6)
    best = result.output_errors[result.best_iteration]
    assert best < result.streaming_error < result.output_errors[0]
    act = ACTIVATIONS[activation]
    hidden = act(result.weights["gate"] @ X) * (result.weights["up"] @ X)
    target = W_d @ (act(W_g @ X) * (W_u @ X))
    error = float((result.weights["down"] @ hidden - target).pow(2).sum() / target.pow(2).sum())
    assert error == pytest.approx(best, rel=1e-8)
    for name in ("gate", "up", "down"):
        B, A = result.factors[name]
        assert B.shape[1] == 5
        torch.testing.assert_close(B @ A, result.weights[name], rtol=1e-8, atol=1e-10)


def test_unknown_activation():
    X, W_g, W_u, W_d = _mlp()
    with pytest.raises(ValueError, match="unknown activation 'swish'.*silu"):
        joint_gated_mlp(W_g, W_u, W_d, X, 2, 2, 2, activation="swish")
