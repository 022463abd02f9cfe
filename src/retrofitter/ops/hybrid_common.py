"""Shared pieces of the LoLCATs hybrid (window softmax + linear) attention executions.

Everything that defines *what* the hybrid layer computes lives here, so the three executions
(``hybrid_naive``, ``hybrid_chunked``, ``hybrid_recurrent``) cannot drift apart:

* window kinds (which keys a query sees through the softmax),
* how the linear terms are weighted (``1`` or ``1 - gamma``),
* positions under padding, input validation, GQA grouping.

Positions. Windows and tiles are counted in *real tokens* of each batch row: the real-token index
of position ``i`` is ``r_i = cumsum(mask)_i - 1``. Padded positions do not exist for the math
(they are in no window and in no state). For a left-padded batch with a sliding window this is
the same as using absolute positions; for terraced windows it makes tile boundaries independent
of the amount of padding, so a padded row computes exactly what the unpadded row computes, and
decoding (which counts real tokens) sees the same tiles as prefill.

Window kinds, for query real-index ``n`` and key real-index ``i`` (``W_n``):

* ``sliding`` of width ``w``: ``n - w + 1 <= i <= n`` (``w`` keys, the query included).
* ``terraced`` with tile ``t`` (= ``window``): ``i <= n`` and ``floor(i/t) >= floor(n/t) - 1``,
  i.e. the keys of the query's tile up to the query plus the whole previous tile
  (between ``t + 1`` and ``2t`` keys once past the first tile).

Keys ``i <= n`` outside ``W_n`` go to the linear state. Both kinds are monotone (a key that left
the window never comes back), which is what lets the recurrent execution evict into ``S, z``.
Key ``i`` leaves at query ``leave_position(i)`` (sliding ``i + w``; terraced ``(floor(i/t) + 2) t``).

Recall (issue: linearized models that remember), two additions to the exact part, both optional:

* **attention sinks**: the first ``sinks`` real tokens are always attended exactly (never in S, z);
* **sparse cache** (LoLA, arXiv 2505.23666) of size ``M`` per kv head: among the keys that left the
  window (sinks aside), the ``M`` that the linear state recalls worst are attended exactly and kept
  out of S, z. A key's recall error is fixed when it is written:
  ``e_i = sum_{h in group} || v_i - phi_k(k_i)^T S_{<i} / (phi_k(k_i)^T z_{<i}) ||^2`` with
  ``S_{<i} = sum_{sinks <= j < i} phi_k(k_j) v_j^T`` over *all* earlier non-sink keys (the state the
  key would be read from if nothing were cached; 0 when empty). So the scores need no sequential
  selection and prefill stays linear in the context. The cache at query ``n`` is the ``M`` keys
  ranked first by ``(e_i, i)`` (larger first) among those that left the window by ``n``; a key that
  drops out never comes back (the set it is ranked in only grows), so it moves to S, z once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = [
    "FeatureMapFn",
    "WindowKind",
    "WINDOW_KINDS",
    "LINEAR_WEIGHTS",
    "RecallSettings",
    "exact_contains",
    "outranks",
    "select_top",
    "recall_error",
    "get_window_kind",
    "get_linear_weight",
    "compute_dtype_for",
    "real_token_positions",
    "compaction_order",
    "check_hybrid_inputs",
]

# What the executions call as phi_q / phi_k: x [b, h, n, dh] -> [b, h, n, F] (any callable; the
# learned maps are ``modules.feature_maps.FeatureMap`` instances).
FeatureMapFn = Callable[[torch.Tensor], torch.Tensor]


def _sliding_contains(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    return (key_pos >= 0) & (key_pos <= query_pos) & (key_pos > query_pos - window)


def _terraced_contains(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    # key_pos >= 0 first: floor(-1 / t) == -1 would otherwise count empty slots as tile "-1".
    return (
        (key_pos >= 0)
        & (key_pos <= query_pos)
        & (torch.div(key_pos, window, rounding_mode="floor") >= torch.div(query_pos, window, rounding_mode="floor") - 1)
    )


def _sliding_evictions(new_pos: torch.Tensor, window: int) -> torch.Tensor:
    # Token L pushes out exactly L - w, which sits in the slot L is written to.
    return (new_pos % window)[:, None]


def _terraced_evictions(new_pos: torch.Tensor, window: int) -> torch.Tensor:
    # Only tile T-2 leaves (when L starts tile T); in a 2t ring it fills half (T mod 2).
    start = torch.remainder(torch.div(new_pos, window, rounding_mode="floor"), 2) * window
    return start[:, None] + torch.arange(window, device=new_pos.device)


def _sliding_leave(key_pos: torch.Tensor, window: int) -> torch.Tensor:
    return key_pos + window


def _terraced_leave(key_pos: torch.Tensor, window: int) -> torch.Tensor:
    return (torch.div(key_pos, window, rounding_mode="floor") + 2) * window


@dataclass(frozen=True)
class WindowKind:
    """A softmax window rule.

    ``contains(query_pos, key_pos, window) -> bool tensor`` (broadcasting; positions are real-token
    indices, negative = no token). ``buffer_factor * window`` keys always cover any ``W_n`` and is
    the ring-buffer size of the recurrent state. ``eviction_slots(new_pos [b], window) -> [b, e]``
    lists the ring slots that can hold keys leaving the window when the token at ``new_pos``
    arrives (a superset; the recurrent step maps only those through phi_k instead of the whole
    buffer). The chunked execution uses chunks of ``window`` queries; for both kinds every key
    two or more chunks back is outside the window. ``leave_position(key_pos, window)`` is the first
    query that no longer sees the key; every key of chunk ``j - leave_lag`` leaves inside chunk ``j``.
    ``evicts_write_slot``: the only key that can leave when token ``L`` arrives sits in the ring slot ``L`` is
    written to (sliding: ``L - w`` in slot ``L mod w``), so writing the new key clears it.
    """

    name: str
    contains: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    buffer_factor: int
    eviction_slots: Callable[[torch.Tensor, int], torch.Tensor]
    leave_position: Callable[[torch.Tensor, int], torch.Tensor]
    leave_lag: int
    evicts_write_slot: bool = False  # the safe default: clear the evicted slots explicitly

    def buffer_size(self, window: int) -> int:
        """Ring-buffer length ``s = buffer_factor * window``: keys (and values) the decode state keeps."""
        return self.buffer_factor * window


WINDOW_KINDS: dict[str, WindowKind] = {
    "sliding": WindowKind("sliding", _sliding_contains, buffer_factor=1, eviction_slots=_sliding_evictions,
                          leave_position=_sliding_leave, leave_lag=1, evicts_write_slot=True),
    "terraced": WindowKind("terraced", _terraced_contains, buffer_factor=2, eviction_slots=_terraced_evictions,
                           leave_position=_terraced_leave, leave_lag=2, evicts_write_slot=False),
}

# Weight of the linear (history) terms given gamma = sigmoid(theta), shape [h].
LINEAR_WEIGHTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "one": torch.ones_like,
    "one_minus_gamma": lambda gamma: 1.0 - gamma,
    "zero": torch.zeros_like,  # no linear part: window (+ sinks, + sparse cache) softmax only
}


@dataclass(frozen=True)
class RecallSettings:
    """What the exact part keeps beyond the window: ``sinks`` first tokens, ``sparse_cache`` keys per kv head."""

    sinks: int = 0
    sparse_cache: int = 0

    def __post_init__(self):
        if self.sinks < 0 or self.sparse_cache < 0:
            raise ValueError(f"sinks and sparse_cache must be >= 0; got {self.sinks}, {self.sparse_cache}")


def exact_contains(kind: WindowKind, query_pos, key_pos, window: int, sinks: int) -> torch.Tensor:
    """``W_n`` plus the sinks: keys the softmax sees before the sparse cache (positions as in ``contains``)."""
    sink = (key_pos >= 0) & (key_pos < sinks) & (key_pos <= query_pos)
    return kind.contains(query_pos, key_pos, window) | sink


def outranks(score_a, pos_a, score_b, pos_b) -> torch.Tensor:
    """Sparse-cache order: ``a`` ranks before ``b`` iff ``(e_a, a) > (e_b, b)`` (larger error, then later)."""
    return (score_a > score_b) | ((score_a == score_b) & (pos_a > pos_b))


def select_top(scores: torch.Tensor, positions: torch.Tensor, eligible: torch.Tensor, size: int) -> torch.Tensor:
    """Bool ``[..., K]``: the ``size`` eligible entries ranked first by ``outranks`` (all if fewer).

    Sorting by position then (stably) by score gives exactly the ``outranks`` order.
    """
    order = torch.argsort(positions, dim=-1, descending=True, stable=True)
    ranked = torch.where(eligible, scores, torch.full_like(scores, float("-inf"))).gather(-1, order)
    order = order.gather(-1, torch.argsort(ranked, dim=-1, descending=True, stable=True))
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return eligible & (rank < size)


def recall_error(phi: torch.Tensor, values: torch.Tensor, kv_state: torch.Tensor, k_state: torch.Tensor,
                 extra_num: torch.Tensor | None = None, extra_den: torch.Tensor | None = None) -> torch.Tensor:
    """``|| v - phi^T S / (phi^T z) ||^2`` per head and key: phi ``[b, h, e, F]``, values ``[b, h, e, dh]``,
    S ``[b, h, F, dh]``, z ``[b, h, F]`` -> ``[b, h, e]``; ``extra_num [b,h,e,dh]`` / ``extra_den [b,h,e]``
    add keys not yet in S, z. The prediction is 0 while nothing is stored (``phi^T z = 0``)."""
    num = phi @ kv_state
    den = (phi @ k_state.unsqueeze(-1)).squeeze(-1)
    if extra_num is not None:
        num, den = num + extra_num, den + extra_den
    pred = torch.where(den[..., None] > 0, num / den.clamp_min(torch.finfo(den.dtype).tiny)[..., None], 0.0)
    return (values - pred).pow(2).sum(dim=-1)


def get_window_kind(name: str) -> WindowKind:
    if name not in WINDOW_KINDS:
        raise ValueError(f"unknown window_kind {name!r}; choose one of {sorted(WINDOW_KINDS)}")
    return WINDOW_KINDS[name]


def get_linear_weight(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in LINEAR_WEIGHTS:
        raise ValueError(f"unknown linear_weight {name!r}; choose one of {sorted(LINEAR_WEIGHTS)}")
    return LINEAR_WEIGHTS[name]


def compute_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; half/bfloat16 are computed in float32 (exp sums and states need it)."""
    return torch.promote_types(dtype, torch.float32)


def real_token_positions(key_padding_mask: torch.Tensor | None, batch: int, length: int, device) -> torch.Tensor:
    """Real-token index of every position, ``[b, n]`` long; ``-1`` at padded positions."""
    if key_padding_mask is None:
        return torch.arange(length, device=device).expand(batch, length)
    ranks = key_padding_mask.long().cumsum(dim=-1) - 1
    return torch.where(key_padding_mask, ranks, torch.full_like(ranks, -1))


def compaction_order(key_padding_mask: torch.Tensor) -> torch.Tensor:
    """``[b, n]`` permutation that moves real tokens to the front, keeping their order.

    ``order[b, p]`` is the original position of the ``p``-th real token of row ``b`` (for
    ``p < count``); padded positions follow.
    """
    return torch.argsort((~key_padding_mask).to(torch.int8), dim=-1, stable=True)


def check_hybrid_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    gamma: torch.Tensor,
    window: int,
) -> None:
    """Shape checks shared by the executions: q ``[b,h,n,dh]``, k/v ``[b,g,n,dh]``, h % g == 0."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [b, heads, n, dh]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, h, n, dh = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2] != n or k.shape[3] != dh:
        raise ValueError(f"k and v must be [b={b}, g, n={n}, dh={dh}]; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if h % k.shape[1] != 0:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({k.shape[1]})")
    if gamma.shape != (h,):
        raise ValueError(f"gamma must have shape [h={h}]; got {tuple(gamma.shape)}")
    if window < 1:
        raise ValueError(f"window must be >= 1; got {window}")
    if key_padding_mask is not None and (key_padding_mask.shape != (b, n) or key_padding_mask.dtype != torch.bool):
        raise ValueError(
            f"key_padding_mask must be bool [b={b}, n={n}]; got {key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
        )
