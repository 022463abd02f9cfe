"""Joint QK / VO Tucker solvers: monotone objective, beat local SVD, exact at full rank, RoPE, GQA."""

import pytest
import torch

from retrofitter.linalg.joint_qk import JointQKSolver, gqa_group_index, rope_relative_rotations
from retrofitter.linalg.joint_vo import JointVOSolver
from retrofitter.linalg.svd import weighted_low_rank

D, H, G, DH = 12, 4, 2, 3


def _attention(seed=0, d=D):
    generator = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    # Weights with a decaying spectrum and inputs with correlated, anisotropic statistics.
    decay = torch.logspace(0, -1.5, d, dtype=torch.float64)
    W_q = randn(H * DH, d) * decay
    W_k = randn(G * DH, d) * decay.flip(0).sqrt()
    W_v = randn(G * DH, d) * decay
    W_o = randn(d, H * DH)
    X = randn(d, d) @ torch.diag(torch.logspace(0.5, -0.5, d, dtype=torch.float64)) @ randn(d, 200)
    return W_q, W_k, W_v, W_o, X @ X.T / 200


def _dense_score_error(W_q, W_k, factors, C, rotations=None):
    """Reference with explicit d×d matrices (test scale only)."""
    root = torch.linalg.cholesky(C)  # any square root gives the same Frobenius norms: ‖Lᵀ M L‖ = ‖S M S‖
    Wq_hat, Wk_hat = factors.B_q @ factors.A_q, factors.B_k @ factors.A_k
    rotations = rotations or [torch.eye(DH, dtype=torch.float64)]
    num = den = 0.0
    for i, g in enumerate(gqa_group_index(H, G).tolist()):
        for R in rotations:
            exact = W_q[i * DH:(i + 1) * DH].T @ R @ W_k[g * DH:(g + 1) * DH]
            approx = Wq_hat[i * DH:(i + 1) * DH].T @ R @ Wk_hat[g * DH:(g + 1) * DH]
            num += float((root.T @ (exact - approx) @ root).pow(2).sum())
            den += float((root.T @ exact @ root).pow(2).sum())
    return num / den


def _non_decreasing(history):
    return all(b >= a * (1 - 1e-12) - 1e-12 for a, b in zip(history, history[1:]))


@pytest.mark.parametrize("use_rope", [False, True])
def test_joint_qk_monotone_matches_dense_and_beats_local(use_rope):
    W_q, W_k, _, _, C = _attention()
    rotations = rope_relative_rotations(DH + 1, 100.0, range(4)) if use_rope else None
    head_dim = DH + 1 if use_rope else DH
    if use_rope:  # RoPE needs an even head dim: pad weights to dh = 4
        W_q = torch.randn(H * head_dim, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        W_k = torch.randn(G * head_dim, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    solver = JointQKSolver(W_q, W_k, C, H, G, head_dim, 4, 4, iterations=8, damping=0.0, rope_rotations=rotations)
    factors = solver.solve()
    assert len(factors.objective_history) == 16
    assert _non_decreasing(factors.objective_history)
    joint = solver.score_error(factors.A_q, factors.B_q, factors.A_k, factors.B_k)
    assert joint == pytest.approx(1 - factors.objective_history[-1] / factors.total_energy, rel=1e-8, abs=1e-12)
    if not use_rope:
        assert joint == pytest.approx(_dense_score_error(W_q, W_k, factors, C), rel=1e-8)
    B_q, A_q = weighted_low_rank(W_q, C, 4, damping=0.0)
    B_k, A_k = weighted_low_rank(W_k, C, 4, damping=0.0)
    local = solver.score_error(A_q, B_q, A_k, B_k)
    assert joint < local


def test_rope_relative_rotation_convention():
    dh, base = 4, 10.0
    q, k = torch.randn(dh, dtype=torch.float64), torch.randn(dh, dtype=torch.float64)

    def rope(x, position):  # HF rotate_half layout
        freqs = base ** (-torch.arange(dh // 2, dtype=torch.float64) * 2 / dh) * position
        cos, sin = torch.cat([freqs.cos(), freqs.cos()]), torch.cat([freqs.sin(), freqs.sin()])
        return x * cos + torch.cat([-x[dh // 2:], x[: dh // 2]]) * sin

    (R,) = rope_relative_rotations(dh, base, [3])
    assert float(rope(q, 7) @ rope(k, 4)) == pytest.approx(float(q @ R @ k), rel=1e-12)


def test_joint_qk_planted_and_full_rank():
    W_q, W_k, _, _, C = _attention(seed=1)
    generator = torch.Generator().manual_seed(9)
    A0 = torch.randn(3, D, generator=generator, dtype=torch.float64)
    planted = JointQKSolver(W_q[:, :3] @ A0, W_k[:, :3] @ A0, C, H, G, DH, 3, 3, damping=0.0)
    factors = planted.solve()
    assert planted.score_error(factors.A_q, factors.B_q, factors.A_k, factors.B_k) < 1e-12
    full = JointQKSolver(W_q, W_k, C, H, G, DH, D, D, iterations=2, damping=1e-3)
    factors = full.solve()
    Wq_hat, Wk_hat = factors.B_q @ factors.A_q, factors.B_k @ factors.A_k
    for i, g in enumerate(gqa_group_index(H, G).tolist()):
        exact = W_q[i * DH:(i + 1) * DH].T @ W_k[g * DH:(g + 1) * DH]
        approx = Wq_hat[i * DH:(i + 1) * DH].T @ Wk_hat[g * DH:(g + 1) * DH]
        torch.testing.assert_close(approx, exact, rtol=1e-9, atol=1e-10)


def test_joint_qk_errors():
    W_q, W_k, _, _, C = _attention()
    with pytest.raises(ValueError, match="do not match"):
        JointQKSolver(W_q, W_k, C, H, G, 4, 2, 2)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        gqa_group_index(4, 3)
    with pytest.raises(ValueError, match="ranks must be in"):
        JointQKSolver(W_q, W_k, C, H, G, DH, D + 1, 2).solve()


def test_joint_vo_monotone_and_beats_separate_local_svd():
    _, _, W_v, W_o, C = _attention(seed=2)
    solver = JointVOSolver(W_v, W_o, C, H, G, DH, rank_v=3, rank_o=4, damping=0.0)
    factors = solver.solve()
    assert _non_decreasing(factors.objective_history)
    joint = solver.map_error(factors.A_v, factors.B_v, factors.B_o, factors.A_o)
    assert joint == pytest.approx(1 - factors.objective_history[-1] / factors.total_energy, rel=1e-8, abs=1e-12)
    # Separate local rootcov SVD with the same ranks (same parameter count): v on C, o on the
    # second moment of its own input (the value heads, repeated per query head as in GQA).
    B_v, A_v = weighted_low_rank(W_v, C, 3, damping=0.0)
    expand = torch.cat([W_v[g * DH:(g + 1) * DH] for g in gqa_group_index(H, G).tolist()])  # [h·dh, d]
    B_o, A_o = weighted_low_rank(W_o, expand @ C @ expand.T, 4, damping=1e-9)
    local = solver.map_error(A_v, B_v, B_o, A_o)
    assert joint < local
    # Full rank reproduces each head's map.
    full = JointVOSolver(W_v, W_o, C, H, G, DH, rank_v=G * DH, rank_o=D, iterations=1, damping=0.0)
    factors = full.solve()
    assert full.map_error(factors.A_v, factors.B_v, factors.B_o, factors.A_o) < 1e-20 + 1e-12
