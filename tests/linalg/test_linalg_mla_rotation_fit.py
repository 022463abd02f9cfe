"""The no-rotation query maps of MLA (linalg/mla_rotation_fit.py) against a naive float64 reference that
enumerates every (query, key) pair: statistics, fitted maps and errors agree; no rotation means M = I."""

from __future__ import annotations

import math

import pytest
import torch

from retrofitter.linalg.mla_rotation_fit import FIT_WEIGHTINGS, RotationFitStatistics, slot_fit

H, G, DH, N = 4, 2, 6, 9


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, N, H, DH, generator=g, dtype=torch.float64)
    k = torch.randn(2, N, G, DH, generator=g, dtype=torch.float64)
    inv_freq = torch.tensor([1.3, 0.4, 0.05], dtype=torch.float64)
    return q, k, inv_freq


def _rot(v, angle):
    c, s = math.cos(angle), math.sin(angle)
    return torch.stack([v[0] * c - v[1] * s, v[1] * c + v[0] * s])


def _naive_fit(q, k, inv_freq, scaling, head, f, mixing, window=None, queries=range(N), uniform=False):
    """Weighted, per-query-centred least squares over explicitly enumerated pairs (module docstring); weights: the
    original attention, or (``uniform``) every allowed key alike."""
    half, gi = DH // 2, head // (H // G)
    rows_phi, rows_y, weights, groups = [], [], [], []
    for batch in range(q.shape[0]):
        for t in queries:
            scores = []
            for s in range(N):
                if s > t or (window and t - s >= window):
                    scores.append(-math.inf)
                    continue
                dot = 0.0
                for ff in range(half):
                    qa = _rot(q[batch, t, head, [ff, ff + half]], t * float(inv_freq[ff]))
                    ka = _rot(k[batch, s, gi, [ff, ff + half]], s * float(inv_freq[ff]))
                    dot += float(qa @ ka)
                scores.append(dot * scaling)
            p = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
            if uniform:
                p = (p > 0).double() / (p > 0).sum()
            qv = q[batch, t, head, [f, f + half]]
            for s in range(N):
                if p[s] == 0:
                    continue
                kv = sum(mixing[g] * k[batch, s, g, [f, f + half]] for g in range(G))
                y = float(_rot(qv, t * float(inv_freq[f])) @ _rot(kv, s * float(inv_freq[f])))
                rows_phi.append(torch.outer(kv, qv).reshape(4))
                rows_y.append(y)
                weights.append(float(p[s]))
                groups.append((batch, t))
    f64 = dict(dtype=torch.float64)
    phi, y, w = torch.stack(rows_phi), torch.tensor(rows_y, **f64), torch.tensor(weights, **f64)
    # centre per query under its attention
    for key in set(groups):
        idx = torch.tensor([i for i, gr in enumerate(groups) if gr == key])
        phi[idx] -= (w[idx, None] * phi[idx]).sum(0)
        y[idx] -= (w[idx] * y[idx]).sum()
    sw = w.sqrt()
    m = torch.linalg.lstsq(sw[:, None] * phi, sw * y).solution
    identity = torch.eye(2, dtype=torch.float64).reshape(4)
    err = lambda vec: float((w * (phi @ vec - y) ** 2).sum())  # noqa: E731
    return m.reshape(2, 2), err(identity), err(m)


@pytest.mark.parametrize("weighting", FIT_WEIGHTINGS)
@pytest.mark.parametrize("window, stride", [(None, 1), (4, 1), (None, 3)])
def test_fit_equals_naive_least_squares_over_every_pair(window, stride, weighting):
    q, k, inv_freq = _inputs()
    stats = RotationFitStatistics.zeros(H, G, DH)
    stats.update(q, k, inv_freq, scaling=0.5, sliding_window=window, query_stride=stride, weighting=weighting)
    queries = range(N - 1, -1, -stride)
    assert stats.queries == 2 * len(queries)
    mixing = torch.tensor([0.6, -0.8], dtype=torch.float64)
    for head, f in ((0, 0), (3, 1), (2, 2)):
        M, before, after = slot_fit(stats, head, f, mixing, damping=0.0)
        M_ref, before_ref, after_ref = _naive_fit(q, k, inv_freq, 0.5, head, f, mixing, window, queries,
                                                  uniform=weighting == "uniform")
        torch.testing.assert_close(M, M_ref, rtol=1e-7, atol=1e-9)
        assert before == pytest.approx(before_ref, rel=1e-9)
        assert after == pytest.approx(after_ref, rel=1e-7, abs=1e-9)
        assert after <= before + 1e-12


def test_no_rotation_means_the_identity_map_and_no_error():
    q, k, _ = _inputs(1)
    stats = RotationFitStatistics.zeros(H, G, DH)
    stats.update(q, k, torch.zeros(DH // 2, dtype=torch.float64), scaling=0.4)
    M, before, after = slot_fit(stats, 1, 2, torch.tensor([1.0, 0.0], dtype=torch.float64), damping=1e-12)
    torch.testing.assert_close(M, torch.eye(2, dtype=torch.float64), rtol=0, atol=1e-8)
    assert abs(before) < 1e-9 and abs(after) < 1e-9


def test_a_fast_frequency_gains_from_the_fit():
    q, k, inv_freq = _inputs(2)
    stats = RotationFitStatistics.zeros(H, G, DH)
    stats.update(q, k, inv_freq, scaling=0.2)  # flat attention: far keys count, a fast rotation averages out
    _, before, after = slot_fit(stats, 0, 0, torch.tensor([1.0, 0.0], dtype=torch.float64))
    assert after < 0.8 * before


def test_uniform_weighting_fits_the_mean_over_distances():
    """Every earlier key weighted alike: M is the least-squares stand-in for the rotation's mean over distances
    0 … t. For θ = 1.3 that mean is O(1 / (θ t)) ≈ 0 beyond a few tokens, so M ≈ 0; for θ = 0.002 the rotation
    stays within 0.13 rad over 64 tokens, so M ≈ I. Bounds: those means plus the sampling noise of ~8k random pairs
    (about 0.03; measured entries: 0.047 and 0.036)."""
    g = torch.Generator().manual_seed(5)
    n = 64
    q = torch.randn(4, n, 2, DH, generator=g, dtype=torch.float64)
    k = torch.randn(4, n, 1, DH, generator=g, dtype=torch.float64)
    stats = RotationFitStatistics.zeros(2, 1, DH)
    stats.update(q, k, torch.tensor([1.3, 0.4, 0.002], dtype=torch.float64), scaling=0.5, weighting="uniform")
    one = torch.ones(1, dtype=torch.float64)
    fast, slow = slot_fit(stats, 0, 0, one)[0], slot_fit(stats, 0, 2, one)[0]
    assert fast.abs().max() < 0.1
    assert (slow - torch.eye(2, dtype=torch.float64)).abs().max() < 0.1
    with pytest.raises(ValueError, match="weighting"):
        stats.update(q, k, torch.zeros(3, dtype=torch.float64), scaling=0.5, weighting="local")
