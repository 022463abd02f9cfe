"""Fitting the linear anchor of a hybrid layer (``hybrid_common``: the linear terms times ``e^{b - alpha c_n}``).

LoLCATs' hybrid weighs its linear (history) terms against exact terms from which the exact max ``c_n`` was
subtracted, so the history's share of query ``n`` is

    R_peg,n = L_n / D_n,   L_n = lam phi_q(q_n)^T z_n,   D_n = gamma sum_{i in E_n} e^{s_ni - c_n}

(``s_ni = q_n.k_i / sqrt(d)``, ``E_n`` the exact set) while the softmax the hybrid replaces gives it

    R_n = sum_{i in H_n} e^{s_ni} / sum_{i in E_n} e^{s_ni}     (``H_n``: the keys in S_n, z_n).

Multiplying the linear terms by ``e^{b - alpha c_n}`` turns ``R_peg`` into ``R_peg e^{b - alpha c_n}``; the fit
makes that equal ``R`` in least squares of the logarithm over calibration queries:

    y_n = log R_n - log R_peg,n = logsumexp_{i in H_n} s_ni - c_n + log gamma - log L_n  ~  b - alpha c_n,

an ordinary regression of ``y`` on ``c`` per head with ``alpha`` clipped to ``[0, 1]`` (``alpha = 0``: the
pegged mix with a constant rescale ``e^b``; ``alpha = 1``: the softmax's own normalisation) and ``b`` the
intercept given the clipped slope. A needle whose logit stands far above the rest raises ``c_n`` and so
lowers the history's weight against it, as the softmax does. ``hybrid_anchor_moments`` computes the
regression's sufficient statistics from the naive definition (``hybrid_terms_naive``), so the fit sees the
exact set the executions use (window, sinks, sparse cache); O(n^2) memory per call.
"""

from __future__ import annotations

import torch

from .hybrid_naive import hybrid_terms_naive

__all__ = ["ANCHOR_MOMENTS", "hybrid_anchor_moments", "fit_anchor"]

# Rows of the moments tensor [5, h]: count, sum c, sum y, sum c^2, sum c y (float64).
ANCHOR_MOMENTS = ("count", "sum_c", "sum_y", "sum_cc", "sum_cy")


def hybrid_anchor_moments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **naive_kwargs) -> torch.Tensor:
    """Regression moments ``[5, h]`` float64 (rows ``ANCHOR_MOMENTS``) of ``(c_n, y_n)`` over the real queries
    that have a history (``L_n > 0``); q ``[b, h, n, dh]``, k/v ``[b, g, n, dh]``, the other arguments as
    ``hybrid_attention_naive``'s (without ``anchor``: the fit is of the pegged mix)."""
    terms = hybrid_terms_naive(q, k, v=v, **naive_kwargs)
    linear_mass = terms["linear"].sum(dim=-1)  # L_n [b, h, n]
    history_logits = terms["logits"].masked_fill(~terms["in_linear"], float("-inf"))
    history_mass = torch.logsumexp(history_logits, dim=-1)  # log sum_{H_n} e^{s} [b, h, n]
    top = terms["max_logit"][..., 0]  # c_n
    gamma = naive_kwargs["gamma"].to(top.dtype).view(1, -1, 1)
    used = terms["real_query"][..., 0] & (linear_mass > 0) & torch.isfinite(history_mass)  # [b, h, n]
    y = history_mass - top + torch.log(gamma) - torch.log(linear_mass.clamp_min(torch.finfo(top.dtype).tiny))
    c, y, w = (t.double().masked_fill(~used, 0.0) for t in (top, y, used.to(top.dtype)))
    return torch.stack([w.sum(dim=(0, 2)), c.sum(dim=(0, 2)), y.sum(dim=(0, 2)), (c * c).sum(dim=(0, 2)),
                        (c * y).sum(dim=(0, 2))])


def fit_anchor(moments: torch.Tensor) -> torch.Tensor:
    """The anchor ``[2, h]`` float32 (rows alpha, b) from summed ``hybrid_anchor_moments``: per head the least
    squares line ``y ~ b - alpha c``, alpha clipped to [0, 1], b refitted for the clipped slope (a head with no
    history queries, or with ``c`` constant, keeps ``alpha = 0`` and its mean ``y``, 0 when empty)."""
    count, sum_c, sum_y, sum_cc, sum_cy = moments.detach().double()
    safe = count.clamp_min(1.0)
    mean_c, mean_y = sum_c / safe, sum_y / safe
    var_c = sum_cc / safe - mean_c**2
    cov = sum_cy / safe - mean_c * mean_y
    spread = var_c > 1e-12 * (1.0 + mean_c**2)
    slope = torch.where(spread, -cov / torch.where(spread, var_c, torch.ones_like(var_c)), torch.zeros_like(var_c))
    alpha = slope.clamp(0.0, 1.0)
    offset = torch.where(count > 0, mean_y + alpha * mean_c, torch.zeros_like(mean_y))
    return torch.stack([alpha, offset]).float()
