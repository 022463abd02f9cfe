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


@dataclass(frozen=True)
class WindowKind:
    """A softmax window rule.

    ``contains(query_pos, key_pos, window) -> bool tensor`` (broadcasting; positions are real-token
    indices, negative = no token). ``buffer_factor * window`` keys always cover any ``W_n`` and is
    the ring-buffer size of the recurrent state. ``eviction_slots(new_pos [b], window) -> [b, e]``
    lists the ring slots that can hold keys leaving the window when the token at ``new_pos``
    arrives (a superset; the recurrent step maps only those through phi_k instead of the whole
    buffer). The chunked execution uses chunks of ``window`` queries; for both kinds every key
    two or more chunks back is outside the window.
    """

    name: str
    contains: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    buffer_factor: int
    eviction_slots: Callable[[torch.Tensor, int], torch.Tensor]

    def buffer_size(self, window: int) -> int:
        """Ring-buffer length ``s = buffer_factor * window``: keys (and values) the decode state keeps."""
        return self.buffer_factor * window


WINDOW_KINDS: dict[str, WindowKind] = {
    "sliding": WindowKind("sliding", _sliding_contains, buffer_factor=1, eviction_slots=_sliding_evictions),
    "terraced": WindowKind("terraced", _terraced_contains, buffer_factor=2, eviction_slots=_terraced_evictions),
}

# Weight of the linear (history) terms given gamma = sigmoid(theta), shape [h].
LINEAR_WEIGHTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "one": torch.ones_like,
    "one_minus_gamma": lambda gamma: 1.0 - gamma,
}


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
