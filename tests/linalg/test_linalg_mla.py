"""MLA conversion math (linalg/mla.py) in float64: the slot mixing is exact, the full budget reproduces the
original scores and values, the rotation-free slots are the low frequencies, smaller budgets degrade gracefully."""

from __future__ import annotations

import pytest
import torch

from retrofitter.linalg.mla import mla_budget, mla_factors, progression_slots

H, G, DH, D = 4, 2, 8, 12


def _rope(x, positions, freqs):
    """Rotate-half RoPE of x [..., n, 2k] at frequencies freqs [k]."""
    angle = positions[:, None].double() * freqs[None, :]
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def _layer(seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    W = {n: torch.randn(rows, D, generator=g, dtype=torch.float64) for n, rows in (("q", H * DH), ("k", G * DH), ("v", G * DH))}
    b = {n: (torch.randn(W[n].shape[0], generator=g, dtype=torch.float64) if bias else None) for n in W}
    x = torch.randn(200, D, generator=g, dtype=torch.float64) * torch.linspace(0.2, 2.0, D, dtype=torch.float64) + 0.3
    inv_freq = 1.0 / (10000 ** (torch.arange(0, DH, 2, dtype=torch.float64) / DH))
    return W, b, x, inv_freq


def _original(W, b, x, inv_freq, positions):
    """Scores [h, n, n] (no scaling, no mask) and values [g, n, dh] of the original layer."""
    lin = {n: x @ W[n].T + (b[n] if b[n] is not None else 0) for n in W}
    q = _rope(lin["q"].view(-1, H, DH).transpose(0, 1), positions, inv_freq)
    k = _rope(lin["k"].view(-1, G, DH).transpose(0, 1), positions, inv_freq).repeat_interleave(H // G, 0)
    return q @ k.transpose(1, 2), lin["v"].view(-1, G, DH).transpose(0, 1)


def _converted(f, x, inv_freq, positions, r_nope):
    q = x @ f.q_weight.T + (f.q_bias if f.q_bias is not None else 0)
    q = q.view(-1, H, q.shape[-1] // H).transpose(0, 1)              # [h, n, r' + 2m]
    c = x @ f.kv_a_weight.T + (f.kv_a_bias if f.kv_a_bias is not None else 0)   # [n, r]
    k_pe = x @ f.k_pe_weight.T + (f.k_pe_bias if f.k_pe_bias is not None else 0)  # [n, 2m]
    freqs = inv_freq[f.freq_index]
    q_nope, q_pe = q[..., :r_nope], _rope(q[..., r_nope:], positions, freqs)
    scores = q_nope @ (c @ f.k_up.T).T + q_pe @ _rope(k_pe, positions, freqs).T
    return scores, (c @ f.v_up.T).view(-1, G, DH).transpose(0, 1)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("metric", ["diagonal", "output"])
def test_full_budget_reproduces_scores_and_values(bias, metric):
    W, b, x, inv_freq = _layer(bias=bias)
    W_o = torch.randn(D, H * DH, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    factors = mla_factors(W["q"], b["q"], W["k"], b["k"], W["v"], b["v"], x.T @ x / len(x), x.mean(0),
                          n_heads=H, n_kv_heads=G, head_dim=DH, inv_freq=inv_freq, kv_rank=G * DH, rope_dim=G * DH,
                          metric=metric, W_o=W_o)
    positions = torch.arange(len(x)) * 7 % 501  # any positions: RoPE of the shared slots is exact
    want_scores, want_values = _original(W, b, x, inv_freq, positions)
    r_nope = factors.k_up.shape[0]
    got_scores, got_values = _converted(factors, x, inv_freq, positions, r_nope)
    assert r_nope == 0 and factors.freq_index.numel() == G * DH // 2
    torch.testing.assert_close(got_scores, want_scores, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got_values, want_values, rtol=1e-9, atol=1e-9)


def test_rotation_free_slots_are_exact_at_distance_zero_and_full_rank():
    """Half the slots without RoPE and a full-rank latent: scores are exact where query and key positions are
    equal (the dropped rotation is the identity), values exact everywhere."""
    W, b, x, inv_freq = _layer(seed=1)
    full_rank = G * DH + G * DH // 2
    factors = mla_factors(W["q"], None, W["k"], None, W["v"], None, x.T @ x / len(x), x.mean(0), n_heads=H,
                          n_kv_heads=G, head_dim=DH, inv_freq=inv_freq, kv_rank=min(full_rank, D), rope_dim=G * DH // 2)
    positions = torch.zeros(len(x), dtype=torch.long)
    want_scores, want_values = _original(W, b, x, inv_freq, positions)
    got_scores, got_values = _converted(factors, x, inv_freq, positions, factors.k_up.shape[0])
    # the latent is limited by d = 12 inputs: [k_nope; v] has rank <= 12, so the fit is exact
    torch.testing.assert_close(got_scores, want_scores, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(got_values, want_values, rtol=1e-8, atol=1e-8)
    # the kept slots are the high frequencies (small index f): dropping rotation costs most there
    assert float(factors.freq_index.double().mean()) < (DH // 2 - 1) / 2


@pytest.mark.parametrize("metric", ["diagonal", "output"])
def test_smaller_budgets_lose_accuracy_monotonically(metric):
    W, b, x, inv_freq = _layer(seed=2)
    W_o = torch.randn(D, H * DH, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    positions = torch.arange(len(x))
    want_scores, want_values = _original(W, b, x, inv_freq, positions)
    errors = []
    for rank in (10, 6, 3):
        f = mla_factors(W["q"], None, W["k"], None, W["v"], None, x.T @ x / len(x), x.mean(0), n_heads=H,
                        n_kv_heads=G, head_dim=DH, inv_freq=inv_freq, kv_rank=rank, rope_dim=4, metric=metric, W_o=W_o)
        _, values = _converted(f, x, inv_freq, positions, f.k_up.shape[0])
        errors.append(float((values - want_values).norm() / want_values.norm()))
    assert errors[0] < errors[1] < errors[2] and errors[2] < 1.0


def test_budget_split_and_limits():
    assert mla_budget(0.25, 3, 64, 1 / 3) == (64, 32)  # SmolLM2: 96 of 384 numbers per token
    assert mla_budget(1.0, 3, 64, 0.5) == (192, 192)
    with pytest.raises(ValueError, match="kv_ratio must lie in"):
        mla_budget(0.001, 3, 64, 1 / 3)
    W, b, x, inv_freq = _layer()
    with pytest.raises(ValueError, match="rope_dim must be even and at most 16"):
        mla_factors(W["q"], None, W["k"], None, W["v"], None, x.T @ x, x.mean(0), n_heads=H, n_kv_heads=G,
                    head_dim=DH, inv_freq=inv_freq, kv_rank=4, rope_dim=18)


def test_progression_slots_are_the_best_geometric_progression_of_frequencies():
    score = torch.rand(16, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for m in (1, 2, 3, 5, 16):
        kept = progression_slots(score, m).tolist()  # integer slot ids: compared exactly
        freqs, comps = [k // 3 for k in kept], [k % 3 for k in kept]
        step = freqs[1] if m > 1 else 1
        assert freqs == [j * step for j in range(m)]  # 0, s, 2s, ...: one rope base holds them
        # each frequency keeps its best component: the largest of three random float64 scores, ties have
        # probability 0, so the argmax is the one index whose score exceeds the others
        assert all(score[f, c] == score[f].max() for f, c in zip(freqs, comps))
        totals = {s: float(score[torch.arange(m) * s].max(1).values.sum()) for s in range(1, 16)
                  if (m - 1) * s < 16}
        # brute force over every step: sums of <= 16 float64 numbers in [0, 1), rounding <= 16 ulp; random
        # totals of different steps differ by far more
        chosen = float(score[freqs, comps].sum())
        assert chosen == pytest.approx(max(totals.values()), rel=1e-12, abs=0)
        assert all(total <= chosen * (1 + 1e-12) for total in totals.values())
    with pytest.raises(ValueError, match="at most 16 slots"):
        progression_slots(score, 17)
