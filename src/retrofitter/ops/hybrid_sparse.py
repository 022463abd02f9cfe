"""Sparse-cache terms of the chunked hybrid execution (LoLA-style; the rule is in ``hybrid_common``).

Queries come in chunks of ``C`` (the chunked execution's chunks, real tokens compacted to the front).
The cache only ever holds keys that left the window, and a key that drops out never returns, so a
scan over the chunks carries it: for chunk ``j`` the candidates are the cache after chunk ``j - 1``
(``M`` slots) and the keys of chunk ``j - leave_lag`` (the ones that leave during chunk ``j``).
Candidate ``c`` is cached for query ``n`` iff it left by ``n`` and fewer than ``M`` candidates that
also left by ``n`` outrank it — the same count as the naive definition, restricted to the only keys
that can be in the running top ``M``. Per chunk this costs ``O(C (M + C) dh)``: linear in the context.

Returned per query (chunked layout ``[b, g, r, m, C, ...]``): the cached keys' softmax terms against
their own max (numerator, denominator, max), and what they would have added to the linear terms
(to subtract: the chunked linear history counts every key that left the window).
"""

from __future__ import annotations

import torch

from .hybrid_common import WindowKind, outranks, select_top

__all__ = ["sparse_cache_terms"]


def sparse_cache_terms(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    scores: torch.Tensor,
    counts: torch.Tensor,
    *,
    kind: WindowKind,
    window: int,
    sinks: int,
    size: int,
    scale: float,
) -> dict[str, torch.Tensor]:
    """The sparse cache's contribution to every query.

    Args (compacted, chunked views): q ``[b, g, r, m, C, dh]``, k/v ``[b, g, m, C, dh]``, phi_q / phi_k
    ``[b, g, r, m, C, F]``, scores ``[b, g, m, C]`` (recall errors), counts ``[b]`` real tokens per row.
    Returns ``num [b,g,r,m,C,dh]``, ``den``/``max`` ``[b,g,r,m,C]`` (softmax terms relative to ``max``,
    -inf when the cache is empty) and ``linear_num`` / ``linear_den`` (phi_q^T phi_k v and phi_q^T phi_k
    summed over the cached keys).
    """
    b, g, r, m, C, dh = q.shape
    feat = phi_q.shape[-1]
    device = q.device
    # The running cache, [b, g, M, ...]; position -1 = empty slot.
    cache_k = k.new_zeros(b, g, size, dh)
    cache_v = v.new_zeros(b, g, size, dh)
    cache_phi = phi_k.new_zeros(b, g, r, size, feat)
    cache_score = scores.new_zeros(b, g, size)
    cache_pos = torch.full((b, g, size), -1, dtype=torch.long, device=device)
    outputs = {name: [] for name in ("num", "den", "max", "linear_num", "linear_den")}
    offsets = torch.arange(C, device=device)
    for j in range(m):
        source = j - kind.leave_lag
        new_pos = (source * C + offsets).expand(b, g, C)  # [b, g, C] real-token index
        if source >= 0:
            new_k, new_v, new_phi, new_score = k[:, :, source], v[:, :, source], phi_k[:, :, :, source], scores[:, :, source]
            new_ok = (new_pos >= sinks) & (new_pos < counts[:, None, None])
        else:
            new_k, new_v, new_phi = k.new_zeros(b, g, C, dh), v.new_zeros(b, g, C, dh), phi_k.new_zeros(b, g, r, C, feat)
            new_score, new_ok = scores.new_zeros(b, g, C), torch.zeros(b, g, C, dtype=torch.bool, device=device)
        cand_k, cand_v = torch.cat([cache_k, new_k], dim=2), torch.cat([cache_v, new_v], dim=2)  # [b, g, K, dh]
        cand_phi = torch.cat([cache_phi, new_phi], dim=3)  # [b, g, r, K, F]
        cand_score, cand_pos = torch.cat([cache_score, new_score], dim=2), torch.cat([cache_pos, new_pos], dim=2)
        cand_ok = torch.cat([cache_pos >= 0, new_ok], dim=2)  # [b, g, K]
        cand_leave = torch.where(cand_ok, kind.leave_position(cand_pos, window), torch.full_like(cand_pos, -1))
        query_pos = j * C + offsets  # [C]
        left = cand_ok[:, :, None, :] & (cand_leave[:, :, None, :] <= query_pos[:, None])  # [b, g, C, K]
        ahead = outranks(cand_score[..., :, None], cand_pos[..., :, None], cand_score[..., None, :], cand_pos[..., None, :])
        count = left.to(cand_score.dtype) @ ahead.to(cand_score.dtype)  # [b, g, C, K]
        member = (left & (count < size))[:, :, None]  # [b, g, 1, C, K]

        logits = torch.einsum("bgrad,bgcd->bgrac", q[:, :, :, j], cand_k) * scale
        logits = logits.masked_fill(~member, float("-inf"))
        top = logits.amax(dim=-1)  # [b, g, r, C]
        weights = torch.exp(logits - torch.where(torch.isfinite(top), top, 0.0)[..., None])  # 0 off the cache
        linear = torch.einsum("bgraf,bgrcf->bgrac", phi_q[:, :, :, j], cand_phi) * member
        outputs["num"].append(torch.einsum("bgrac,bgcd->bgrad", weights, cand_v))
        outputs["den"].append(weights.sum(dim=-1))
        outputs["max"].append(top)
        outputs["linear_num"].append(torch.einsum("bgrac,bgcd->bgrad", linear, cand_v))
        outputs["linear_den"].append(linear.sum(dim=-1))

        # Cache after the chunk: every candidate has left by its last query.
        keep = select_top(cand_score, cand_pos, cand_ok, size)
        kept = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., :size]
        kept_ok = keep.gather(2, kept)
        pick = kept[..., None].expand(b, g, size, dh)
        cache_k = torch.where(kept_ok[..., None], cand_k.gather(2, pick), 0.0)
        cache_v = torch.where(kept_ok[..., None], cand_v.gather(2, pick), 0.0)
        cache_phi = cand_phi.gather(3, kept[:, :, None, :, None].expand(b, g, r, size, feat))
        cache_score = torch.where(kept_ok, cand_score.gather(2, kept), 0.0)
        cache_pos = torch.where(kept_ok, cand_pos.gather(2, kept), -1)
    return {name: torch.stack(parts, dim=3) for name, parts in outputs.items()}
