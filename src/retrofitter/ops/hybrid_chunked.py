"""Chunked execution of the LoLCATs hybrid attention (training and prefill), memory O(n (w + F dh / w)).

Same output as ``hybrid_naive`` (see its docstring for the formula). Queries are processed in
chunks of ``C = window`` tokens (the tile for terraced windows). For every window kind in
``hybrid_common.WINDOW_KINDS`` the window of a query in chunk ``j`` lies inside chunks ``j-1, j``,
and every key in chunks ``<= j-2`` is in the linear history. So per chunk:

* softmax terms: scores against the ``2C`` keys of chunks ``j-1, j`` with the window mask
  (``[b, h, m, C, 2C]`` logits, ``m = n / C`` chunks) and the exact window max ``c_n``;
* linear terms from chunk ``j-1`` keys that already left the window (sliding: key ``i <= n - w``),
  as a masked ``C x C`` product ``(phi_q phi_k^T * mask) v``; empty for terraced windows;
* linear terms from chunks ``<= j-2``: ``phi_q(q)^T S_{j-2}`` with ``S_j = sum_{j' <= j} sum_c
  phi_k(k) v^T`` an inclusive cumulative sum of per-chunk states ``[b, h, m, F, dh]``.

Sinks and the sparse cache (``recall``): the sink keys (the first ``S`` real tokens) join every
chunk's softmax block for the queries whose window does not hold them, and never enter the linear
sums; the sparse cache's terms come from a scan over the chunks (``hybrid_sparse``), joined to the
softmax under one exact max and subtracted from the linear history, which counts every key that left.

Padding. Real tokens are first moved to the front of each row (stable, so order is kept), which
makes tiles line up with chunks in every row (positions are real-token indices, see
``hybrid_common``); padded positions then sit after every real query and are never read by one.
Outputs are moved back and zeroed at padded positions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .hybrid_common import (
    FeatureMapFn,
    RecallSettings,
    check_hybrid_inputs,
    compaction_order,
    compute_dtype_for,
    get_linear_weight,
    get_window_kind,
)
from .hybrid_sparse import sparse_cache_terms
from .hybrid_state import HybridRecurrentState, prefill_state, recall_scores

__all__ = ["hybrid_attention_chunked"]


def _gather_tokens(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x ``[b, heads, n, dh]`` reordered along n by ``order`` ``[b, n]``."""
    return x.gather(2, order[:, None, :, None].expand(x.shape))


def _shift_chunks(x: torch.Tensor, by: int, dim: int) -> torch.Tensor:
    """Shift along the chunk axis ``dim`` by ``by`` chunks, filling with zeros (chunk j gets j - by)."""
    pad_shape = list(x.shape)
    pad_shape[dim] = min(by, x.shape[dim])
    if by >= x.shape[dim]:
        return x.new_zeros(pad_shape)
    kept = x.narrow(dim, 0, x.shape[dim] - by)
    return torch.cat([x.new_zeros(pad_shape), kept], dim=dim)


def hybrid_attention_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    feature_map_q: FeatureMapFn,
    feature_map_k: FeatureMapFn,
    gamma: torch.Tensor,
    window: int,
    window_kind: str = "sliding",
    linear_weight: str = "one",
    key_padding_mask: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    return_state: bool = False,
    recall: RecallSettings = RecallSettings(),
) -> tuple[torch.Tensor, HybridRecurrentState | None]:
    """Hybrid attention in chunks of ``window`` queries.

    Args: as ``hybrid_naive.hybrid_attention_naive``; q ``[b, h, n, dh]``, k/v ``[b, g, n, dh]``.
    Returns: ``(y [b, h, n, dh] in q.dtype, state)``; ``state`` is the recurrent state after the
    last real token of every row when ``return_state`` (for decoding), else None.
    """
    check_hybrid_inputs(q, k, v, key_padding_mask, gamma, window)
    kind = get_window_kind(window_kind)
    lam_of = get_linear_weight(linear_weight)
    b, h, n, dh = q.shape
    g = k.shape[1]
    r = h // g  # query heads per kv head
    dtype = compute_dtype_for(q.dtype)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(dh)
    chunk = window
    m = -(-n // chunk)  # number of chunks
    padded_len = m * chunk

    if n == 0:
        raise ValueError("hybrid attention needs at least one token (n == 0)")
    order = None
    q_c, k_c, v_c = q.to(dtype), k.to(dtype), v.to(dtype)
    if key_padding_mask is not None:
        order = compaction_order(key_padding_mask)  # real tokens first, order kept
        q_c, k_c, v_c = (_gather_tokens(x, order) for x in (q_c, k_c, v_c))
    # Zero tail to a whole number of chunks: only read by tail queries (discarded).
    q_c, k_c, v_c = (F.pad(x, (0, 0, 0, padded_len - n)) for x in (q_c, k_c, v_c))

    counts = key_padding_mask.sum(-1) if key_padding_mask is not None else torch.full((b,), n, device=q.device)
    sink_k, sink_v = k_c[:, :, : recall.sinks], v_c[:, :, : recall.sinks]  # [b, g, S, dh] (compacted: real first)
    phi_q = feature_map_q(q_c)  # [b, h, N, F]
    phi_k = feature_map_k(k_c.repeat_interleave(r, dim=1))  # [b, h, N, F] (maps are per query head)
    if recall.sinks:  # sinks never enter the linear sums
        phi_k = phi_k * (torch.arange(padded_len, device=q.device) >= recall.sinks)[:, None]
    feat = phi_q.shape[-1]

    # Chunked, grouped views: query heads as [g, r] so k, v need not be repeated for the softmax.
    q_c = q_c.view(b, g, r, m, chunk, dh)
    phi_q = phi_q.view(b, g, r, m, chunk, feat)
    phi_k = phi_k.view(b, g, r, m, chunk, feat)
    k_c = k_c.view(b, g, m, chunk, dh)
    v_c = v_c.view(b, g, m, chunk, dh)
    k_prev, v_prev = _shift_chunks(k_c, 1, dim=2), _shift_chunks(v_c, 1, dim=2)
    k_pair = torch.cat([k_prev, k_c], dim=3)  # [b, g, m, 2C, dh]: chunks j-1, j
    v_pair = torch.cat([v_prev, v_c], dim=3)

    # Masks from the shared window rule on (compacted) real-token positions.
    starts = torch.arange(m, device=q.device)[:, None] * chunk
    query_pos = (starts + torch.arange(chunk, device=q.device))[:, :, None]  # [m, C, 1]
    key_pos = (starts - chunk + torch.arange(2 * chunk, device=q.device))[:, None, :]  # [m, 1, 2C]
    in_window = kind.contains(query_pos, key_pos, window)  # [m, C, 2C]
    prev_pos = key_pos[..., :chunk]
    in_linear_prev = (prev_pos >= 0) & (prev_pos <= query_pos) & ~in_window[..., :chunk]  # [m, C, C]

    gamma_c = gamma.to(dtype).view(1, g, r, 1, 1, 1)
    lam = lam_of(gamma.to(dtype)).view(1, g, r, 1, 1)

    # Softmax part over the window (+ sinks outside it), c_n = exact max over every exact key.
    logits = torch.einsum("bgrmad,bgmcd->bgrmac", q_c, k_pair) * scale
    logits = logits.masked_fill(~in_window, float("-inf"))
    if recall.sinks:
        sink_pos = torch.arange(sink_k.shape[2], device=q.device)
        sink_seen = (sink_pos <= query_pos) & ~kind.contains(query_pos, sink_pos, window)  # [m, C, S]
        sink_logits = torch.einsum("bgrmad,bgsd->bgrmas", q_c, sink_k) * scale
        logits = torch.cat([logits, sink_logits.masked_fill(~sink_seen, float("-inf"))], dim=-1)
        v_pair = torch.cat([v_pair, sink_v[:, :, None].expand(b, g, m, -1, dh)], dim=3)
    top = logits.amax(dim=-1)  # [b, g, r, m, C]
    sparse = None
    if recall.sparse_cache:
        with torch.no_grad():  # the selection is discrete; gradients flow through the cached keys' terms
            key_errors = recall_scores(k, v, key_padding_mask, feature_map_k=feature_map_k, n_heads=h,
                                       sinks=recall.sinks)  # [b, g, n] at the original positions
        errors = key_errors if order is None else key_errors.gather(2, order[:, None, :].expand(b, g, n))
        errors = F.pad(errors, (0, padded_len - n)).view(b, g, m, chunk)
        sparse = sparse_cache_terms(q_c, k_c, v_c, phi_q, phi_k, errors, counts, kind=kind, window=window,
                                    sinks=recall.sinks, size=recall.sparse_cache, scale=scale)
        top = torch.maximum(top, sparse["max"])
    weights = gamma_c * torch.exp(logits - top[..., None])  # [b, g, r, m, C, 2C (+ S)]
    numerator = torch.einsum("bgrmac,bgmcd->bgrmad", weights, v_pair)
    denominator = weights.sum(dim=-1)  # [b, g, r, m, C]
    if sparse is not None:
        rescale = gamma_c[..., 0] * torch.exp(sparse["max"] - top)  # 0 where the cache is empty
        numerator = numerator + rescale[..., None] * sparse["num"]
        denominator = denominator + rescale * sparse["den"]

    # Linear part, history of chunks <= j-2 through the cumulative chunk states.
    chunk_kv = torch.einsum("bgrmcf,bgmcd->bgrmfd", phi_k, v_c)  # [b, g, r, m, F, dh]
    kv_before = _shift_chunks(chunk_kv.cumsum(dim=3), 2, dim=3)
    k_before = _shift_chunks(phi_k.sum(dim=4).cumsum(dim=3), 2, dim=3)  # [b, g, r, m, F]
    linear_num = torch.einsum("bgrmaf,bgrmfd->bgrmad", phi_q, kv_before)
    linear_den = torch.einsum("bgrmaf,bgrmf->bgrma", phi_q, k_before)
    # Keys of chunk j-1 that left the window (sliding windows only; a no-op mask for terraced). Under
    # torch.compile the masked update always runs (exact either way; a data-dependent branch breaks the graph).
    if torch.compiler.is_compiling() or bool(in_linear_prev.any()):
        scores = torch.einsum("bgrmaf,bgrmcf->bgrmac", phi_q, _shift_chunks(phi_k, 1, dim=3))
        scores = scores.masked_fill(~in_linear_prev, 0.0)
        linear_num = linear_num + torch.einsum("bgrmac,bgmcd->bgrmad", scores, v_prev)
        linear_den = linear_den + scores.sum(dim=-1)
    if sparse is not None:  # cached keys are attended exactly, not through the linear state
        linear_num = linear_num - sparse["linear_num"]
        linear_den = linear_den - sparse["linear_den"]

    y = (numerator + lam[..., None] * linear_num) / (denominator + lam * linear_den)[..., None]
    y = y.reshape(b, h, padded_len, dh)[:, :, :n]
    if order is not None:
        y = _gather_tokens(y, torch.argsort(order, dim=-1))  # back to the original positions
        y = torch.where(key_padding_mask[:, None, :, None], y, torch.zeros_like(y))
    state = None
    if return_state:
        state = prefill_state(
            k, v, key_padding_mask, feature_map_k=feature_map_k, n_heads=h, window=window, window_kind=window_kind,
            recall=recall, scores=key_errors if sparse is not None else None, linear_state=linear_weight != "zero",
        )
    return y.to(q.dtype), state
