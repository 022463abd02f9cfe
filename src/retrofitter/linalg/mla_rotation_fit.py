"""The query maps of MLA slots that lose their rotation, fitted to the original scores under its attention.

A slot (c, f) kept out of the shared rotary key loses RoPE (linalg/mla.py): its score term, originally

    y_ts = (R_f(t) q'_t)ᵀ (R_f(s) k'_s) = q'_tᵀ R_f(s − t) k'_s        (q', k' the slot's 2-vectors)

becomes q'_tᵀ k'_s — exact at distance 0, and for a fast frequency a term that no longer averages out over
distant keys. Any map M [2, 2] on the query side costs nothing (it folds into q_proj), so per query head i
and slot we take the M that best reproduces y under the original attention p_ts of that head:

    M = argmin Σ_t Var_{s ~ p_t}[ (M q'_t)ᵀ k'_s − y_ts ]

the variance over the keys a query attends to: a shift common to all keys of one query leaves the softmax
unchanged, and ½ Var_p of the score error is the attention's KL to second order. With φ_ts = vec(k'_s q'_tᵀ)
[4] (entry (a, b) = k'_a q'_b, so (M q')ᵀ k' = ⟨vec M, φ⟩), it is least squares:

    G vec M = g,   G = Σ_t Cov_{p_t}(φ, φ) [4, 4],   g = Σ_t Cov_{p_t}(φ, y) [4]

With ``weighting="uniform"`` p_ts is 1/(t + 1) over every earlier key instead (``update``): M then reproduces the
term's mean over distances 0 … t, which for a fast frequency averages out (M → 0) and for a slow one stays
(M → I) — the fit for keys far away, where retrieval reads, rather than for the near keys the attention weighs.

M = I is the conversion without the fit. The slot basis is chosen later (U_f mixes the kv heads, linalg/mla.py),
so the sums are kept in the original basis, per query head i, frequency f and pair of kv heads (g1, g2):
k'_s = Σ_g U_f[g, c] k_{g,f,s} and q' = U_f[group(i), c] q_{i,f}, and the statistics are bilinear in U_f[:, c]
(``slot_fit``). The common factor U_f[group(i), c]² drops out of M.

Shapes: b batch, n tokens, h query heads, g kv heads, dh head dim, F = dh/2 frequency pairs. Statistics in
float64; the per-block products in the inputs' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FIT_WEIGHTINGS", "RotationFitStatistics", "slot_fit"]

FIT_WEIGHTINGS = ("attention", "uniform")  # p_ts of the fit: the original attention, or every earlier key alike


def _pairs(x: torch.Tensor) -> torch.Tensor:
    """[..., dh] -> [..., F, 2]: frequency pair f = (dim f, dim f + dh/2) (rotate-half layout)."""
    half = x.shape[-1] // 2
    return torch.stack([x[..., :half], x[..., half:]], -1)


def _rotate(pairs: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """RoPE of pairs [n, ..., F, 2] by angle [n, F] (HF rotate-half: a' = a cos − b sin, b' = b cos + a sin)."""
    shape = (angle.shape[0],) + (1,) * (pairs.dim() - 3) + (angle.shape[1],)
    cos, sin = angle.cos().view(shape), angle.sin().view(shape)
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], -1)


@dataclass
class RotationFitStatistics:
    """Sums over calibration queries t of covariances under the original attention p_t (module docstring).

    gram   [h, F, g, g, 2, 2, 2, 2]  (i, f, g1, g2, a, b, a', b'): Σ_t q_{t,b} q_{t,b'} Cov_p(k^{g1}_a, k^{g2}_{a'})
    cross  [h, F, g, g, 2, 2]        (i, f, g1, g2, a, b):         Σ_t q_{t,b} Cov_p(k^{g1}_a, Y^{g2})
    target [h, F, g, g]              Σ_t Cov_p(Y^{g1}, Y^{g2}),  Y^g_ts = (R(t) q_{i,f,t})ᵀ (R(s) k_{g,f,s})
    """

    gram: torch.Tensor
    cross: torch.Tensor
    target: torch.Tensor
    queries: int = 0

    @classmethod
    def zeros(cls, n_heads: int, n_kv_heads: int, head_dim: int, device=None) -> "RotationFitStatistics":
        F, g = head_dim // 2, n_kv_heads
        f64 = dict(dtype=torch.float64, device=device)
        return cls(torch.zeros(n_heads, F, g, g, 2, 2, 2, 2, **f64), torch.zeros(n_heads, F, g, g, 2, 2, **f64),
                   torch.zeros(n_heads, F, g, g, **f64))

    @torch.no_grad()
    def update(self, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
               sliding_window: int | None = None, query_stride: int = 1, weighting: str = "attention") -> None:
        """Add one batch: q [b, n, h, dh] and k [b, n, g, dh] before RoPE, at positions 0 … n − 1 (causal);
        p = softmax(scaling · RoPE(q) · RoPE(k)ᵀ) per query head (``weighting`` "attention"), or uniform over
        the allowed keys ("uniform"); keys within ``sliding_window`` if set.
        ``query_stride``: only the queries at n − 1, n − 1 − stride, … are summed (every key is read); the
        cost, [F, g, n / stride, n] per head, is the fit's."""
        if weighting not in FIT_WEIGHTINGS:
            raise ValueError(f"fit weighting must be one of {FIT_WEIGHTINGS}, got {weighting!r}")
        b, n, h, dh = q.shape
        g, F = k.shape[2], dh // 2
        positions = torch.arange(n, device=q.device, dtype=torch.float64)
        angle = (positions[:, None] * inv_freq.to(positions)[None, :]).to(q.dtype)   # [n, F]
        rows = torch.arange(n - 1, -1, -query_stride, device=q.device).flip(0)       # the queries summed
        dist = positions[rows, None] - positions[None, :]
        allowed = dist >= 0
        if sliding_window:
            allowed &= dist < sliding_window
        for batch in range(b):
            qp, kp = _pairs(q[batch]), _pairs(k[batch])                              # [n, h, F, 2], [n, g, F, 2]
            qr, kr = _rotate(qp, angle)[rows], _rotate(kp, angle)
            qp, t = qp[rows], len(rows)
            kk = (kp[:, :, None, :, :, None] * kp[:, None, :, :, None, :])          # [n, g, g, F, 2, 2]
            kk = kk.permute(0, 3, 1, 2, 4, 5).reshape(n, -1)                         # [n, F·g·g·4]
            for i in range(h):
                gi = i // (h // g)
                if weighting == "uniform":
                    p = allowed.to(q.dtype) / allowed.sum(-1, keepdim=True).to(q.dtype)  # [t, s]
                else:
                    scores = (qr[:, i].reshape(t, -1) @ kr[:, gi].reshape(n, -1).T) * scaling
                    p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)  # [t, s]
                k_mean = (p @ kp.permute(0, 2, 1, 3).reshape(n, -1)).view(t, -1, g, 2)  # [t, F, g, 2]
                k_cov = ((p @ kk).view(t, -1, g, g, 2, 2)                            # Cov_p [t, F, g, g, 2, 2]
                         - k_mean[:, :, :, None, :, None] * k_mean[:, :, None, :, None, :])
                qi = qp[:, i]                                                        # [t, F, 2]
                self.gram[i] += torch.einsum("tfb,tfc,tfghad->fghabdc", qi, qi, k_cov).to(self.gram)
                # Y[f, g, t, s]: pair f's score term of query t and key s of kv head g (batched matrix products
                # in contiguous layouts: these [F, g, n, n] tensors are the cost of the whole fit)
                Y = torch.matmul(qr[:, i].permute(1, 0, 2)[:, None], kr.permute(2, 1, 3, 0))   # [F, g, t, s]
                PY = Y * p
                y_mean = PY.sum(-1)                                                  # [F, g, t]
                kY = torch.bmm(PY.reshape(F, g * t, n), kp.permute(2, 0, 1, 3).reshape(F, n, g * 2))
                kY = kY.view(F, g, t, g, 2).permute(2, 0, 3, 1, 4)                   # [t, F, g1 (key), g2 (Y), a]
                kY = kY - k_mean[:, :, :, None, :] * y_mean.permute(2, 0, 1)[:, :, None, :, None]
                self.cross[i] += torch.einsum("tfb,tfgha->fghab", qi, kY).to(self.cross)
                YY = torch.bmm(PY.view(F, g, t * n), Y.view(F, g, t * n).transpose(1, 2))
                YY = YY - torch.bmm(y_mean, y_mean.transpose(1, 2))                  # [F, g, g]
                self.target[i] += YY.to(self.target)
        self.queries += b * len(rows)


def slot_fit(stats: RotationFitStatistics, head: int, f: int, mixing: torch.Tensor,
             damping: float = 1e-6) -> tuple[torch.Tensor, float, float]:
    """(M [2, 2], error with M = I, error with M) of query head ``head`` at the slot of frequency ``f`` whose kv
    mixing column is ``mixing`` [g] (U_f[:, c]); errors = Σ_t Var_p of the score error, per U_f[group, c]² = 1.
    ``damping``: relative ridge on G (a slot no query reads gets M ≈ 0, its term dropped)."""
    v = mixing.detach().to(stats.gram)
    G = torch.einsum("g,h,ghabcd->abcd", v, v, stats.gram[head, f]).reshape(4, 4)
    g = torch.einsum("g,h,ghab->ab", v, v, stats.cross[head, f]).reshape(4)
    t = float(v @ stats.target[head, f] @ v)
    G = (G + G.T) / 2
    ridge = damping * float(G.diagonal().mean().clamp_min(1e-300))
    m = torch.linalg.solve(G + ridge * torch.eye(4, dtype=G.dtype, device=G.device), g)
    identity = torch.eye(2, dtype=G.dtype, device=G.device).reshape(4)
    error_identity = t - 2 * float(identity @ g) + float(identity @ G @ identity)
    error_fit = t - 2 * float(m @ g) + float(m @ G @ m)
    return m.reshape(2, 2), error_identity, error_fit
