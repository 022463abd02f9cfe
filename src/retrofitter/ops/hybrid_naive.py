"""Quadratic reference execution of the LoLCATs hybrid attention (the definition the others must match).

For query ``n`` of head ``h`` (kv head ``h // (H/G)``), with ``W_n`` the softmax window
(see ``hybrid_common`` for window kinds and how padding is handled):

    c_n  = max_{i in W_n} q_n.k_i / sqrt(d)
    U_n  = sum_{i in W_n} gamma e^{q_n.k_i/sqrt(d) - c_n} v_i,    D_n = sum_{i in W_n} gamma e^{...}
    S_n  = sum_{i <= n, i not in W_n} phi_k(k_i) v_i^T,          z_n = sum_{...} phi_k(k_i)
    y_n  = (U_n + lam phi_q(q_n)^T S_n) / (D_n + lam phi_q(q_n)^T z_n)

with ``gamma = sigmoid(theta_h)`` and ``lam = 1``, ``1 - gamma`` or ``0`` (``linear_weight``). With
sinks and a sparse cache (``recall``, see ``hybrid_common``) the exact set is ``W_n`` + the sinks +
the cache at ``n`` (``C_n``: the ``M`` top-ranked keys that left the window), and S, z hold the other
older keys; ``c_n`` is the max over the whole exact set. Note that
subtracting ``c_n`` only from the softmax terms is part of the formulation (the linear terms are
weighed against a window whose largest weight is ``gamma``), not a numerical trick.

Memory is O(b h n^2): use only for tests and tiny inputs.
"""

from __future__ import annotations

import math

import torch

from .hybrid_common import (
    FeatureMapFn,
    RecallSettings,
    check_hybrid_inputs,
    exact_contains,
    outranks,
    recall_error,
    compute_dtype_for,
    get_linear_weight,
    get_window_kind,
    real_token_positions,
)
from .hybrid_recurrent import HybridRecurrentState, prefill_state

__all__ = ["hybrid_attention_naive"]


def hybrid_attention_naive(
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
    """Hybrid attention by materialising all ``n x n`` scores.

    Args:
        q: ``[b, h, n, dh]`` queries (after RoPE). k, v: ``[b, g, n, dh]``.
        feature_map_q, feature_map_k: ``[b, h, n, dh] -> [b, h, n, F]`` (per query head).
        gamma: ``[h]`` mixing weights in (0, 1).
        window: window width (sliding) or tile size (terraced).
        key_padding_mask: ``[b, n]`` bool, True = real token. Padded outputs are zero.

    Returns:
        ``(y [b, h, n, dh] in q.dtype, state)``; ``state`` is the recurrent state after the last
        real token of every row when ``return_state``, else None (same signature as the chunked path).
    """
    check_hybrid_inputs(q, k, v, key_padding_mask, gamma, window)
    kind = get_window_kind(window_kind)
    linear_scale = get_linear_weight(linear_weight)
    b, h, n, dh = q.shape
    groups = h // k.shape[1]
    dtype = compute_dtype_for(q.dtype)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(dh)

    q_c = q.to(dtype)
    k_c = k.to(dtype).repeat_interleave(groups, dim=1)  # [b, h, n, dh]: head i reads kv head i // groups
    v_c = v.to(dtype).repeat_interleave(groups, dim=1)
    gamma_c = gamma.to(dtype).view(1, h, 1, 1)
    lam = linear_scale(gamma.to(dtype)).view(1, h, 1, 1)

    positions = real_token_positions(key_padding_mask, b, n, q.device)  # [b, n], -1 = padding
    query_pos = positions[:, None, :, None]  # [b, 1, n, 1]
    key_pos = positions[:, None, None, :]  # [b, 1, 1, n]
    real_query = query_pos >= 0
    causal_real = real_query & (key_pos >= 0) & (key_pos <= query_pos)
    in_window = causal_real & exact_contains(kind, query_pos, key_pos, window, recall.sinks)  # [b, 1, n, n]
    if recall.sparse_cache:
        in_window = in_window | _sparse_members(k_c, v_c, feature_map_k, positions, kind, window, recall, groups)
    in_linear = causal_real & ~in_window

    logits = torch.einsum("bhnd,bhid->bhni", q_c, k_c) * scale
    # Padded queries have an empty window; give them all keys so c_n stays finite (output zeroed).
    softmax_keys = in_window | ~real_query
    logits = logits.masked_fill(~softmax_keys, float("-inf"))
    max_logit = logits.amax(dim=-1, keepdim=True)  # c_n
    weights = gamma_c * torch.exp(logits - max_logit)  # exactly 0 outside the window

    linear_scores = torch.einsum("bhnf,bhif->bhni", feature_map_q(q_c), feature_map_k(k_c))
    linear_scores = lam * linear_scores.masked_fill(~in_linear, 0.0)

    all_weights = weights + linear_scores
    numerator = all_weights @ v_c
    denominator = all_weights.sum(dim=-1, keepdim=True)
    y = numerator / denominator
    y = torch.where(real_query, y, torch.zeros_like(y))
    state = None
    if return_state:
        state = prefill_state(
            k, v, key_padding_mask, feature_map_k=feature_map_k, n_heads=h, window=window, window_kind=window_kind,
            recall=recall, linear_state=linear_weight != "zero",
        )
    return y.to(q.dtype), state


def _sparse_members(k_h, v_h, feature_map_k, positions, kind, window: int, recall: RecallSettings,
                    groups: int) -> torch.Tensor:
    """``[b, h, n, n]`` bool: key ``i`` is in the sparse cache of query ``n`` (by the definition, quadratically).

    k_h, v_h ``[b, h, n, dh]`` (kv heads repeated); positions ``[b, n]`` real-token indices (-1 = padding).
    """
    b, h, n, _ = k_h.shape
    stored = positions >= recall.sinks  # [b, n]: real non-sink keys (they enter S_{<i})
    earlier = (positions[:, None, :] < positions[:, :, None]) & stored[:, None, :]  # [b, i, j]: j < i
    phi = feature_map_k(k_h)  # [b, h, n, F]
    inner = (phi @ phi.transpose(-1, -2)) * earlier[:, None]  # phi(k_i).phi(k_j) for j in S_{<i}
    zero_kv = phi.new_zeros(b, h, phi.shape[-1], v_h.shape[-1])
    error = recall_error(phi, v_h, zero_kv, phi.new_zeros(b, h, phi.shape[-1]), inner @ v_h, inner.sum(dim=-1))
    scores = error.view(b, h // groups, groups, n).sum(dim=2)  # [b, g, n]
    left = stored[:, None, :] & (kind.leave_position(positions, window)[:, None, :] <= positions[:, :, None])  # [b, n, i]
    # i is cached at n iff it left by n and fewer than M keys that also left by n outrank it.
    ahead = outranks(scores[..., :, None], positions[:, None, :, None], scores[..., None, :], positions[:, None, None, :])
    count = left[:, None].to(scores.dtype) @ ahead.to(scores.dtype)  # [b, g, n, i]
    member = left[:, None] & (count < recall.sparse_cache)
    return member.repeat_interleave(groups, dim=1)
