"""Decode state of the LoLCATs hybrid attention and the state a prefill leaves (``prefill_state``).

State per batch row (``s`` = ring-buffer size: ``w`` for sliding, ``2t`` for terraced windows;
``S`` sinks and ``M`` sparse-cache slots, both 0 unless set, see ``hybrid_common``):

* ring buffer of the window's keys/values ``[b, g, s, dh]`` (input dtype), the real-token index
  of each slot ``[b, s]`` (-1 = empty) and its validity ``[b, s]``;
* ``S = sum phi_k(k_i) v_i^T`` ``[b, h, F, dh]`` and ``z = sum phi_k(k_i)`` ``[b, h, F]`` over the
  keys that left the window and are neither sinks nor in the sparse cache (per *query* head,
  because the feature maps are per query head); width 0 (``[b, h, 0, dh]``, ``[b, h, 0]``) for a
  layer without a linear part (``linear_weight="zero"``: nothing reads them, so nothing keeps them);
* sink keys/values ``[b, g, S, dh]`` (slot ``p`` holds real token ``p``);
* sparse cache keys/values ``[b, g, M, dh]``, their recall errors ``[b, g, M]`` and real-token
  indices ``[b, g, M]`` (-1 = empty slot), and the scoring state ``S_all, z_all`` (``[b, h, F, dh]``,
  ``[b, h, F]``; width 0 when ``M = 0``): every non-sink key that left the window, cached or not;
* ``num_tokens`` ``[b]``: real tokens seen so far (= real-token index of the next token).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

from .hybrid_common import (
    FeatureMapFn,
    RecallSettings,
    compaction_order,
    compute_dtype_for,
    get_window_kind,
    real_token_positions,
    recall_error,
    select_top,
)

__all__ = ["HybridRecurrentState", "prefill_state", "recall_scores"]


@dataclass
class HybridRecurrentState:
    """Decode cache of one hybrid attention layer (see the module docstring for the fields)."""

    keys: torch.Tensor  # [b, g, s, dh]
    values: torch.Tensor  # [b, g, s, dh]
    positions: torch.Tensor  # [b, s] long, real-token index per slot, -1 = empty
    valid: torch.Tensor  # [b, s] bool
    kv_state: torch.Tensor  # S: [b, h, F, dh]
    k_state: torch.Tensor  # z: [b, h, F]
    num_tokens: torch.Tensor  # [b] long
    sink_keys: torch.Tensor  # [b, g, S, dh]
    sink_values: torch.Tensor  # [b, g, S, dh]
    sparse_keys: torch.Tensor  # [b, g, M, dh]
    sparse_values: torch.Tensor  # [b, g, M, dh]
    sparse_scores: torch.Tensor  # [b, g, M] recall error e_i
    sparse_positions: torch.Tensor  # [b, g, M] long, -1 = empty
    score_kv: torch.Tensor  # S_all: [b, h, F, dh] ([b, h, 0, dh] without a sparse cache)
    score_k: torch.Tensor  # z_all: [b, h, F] ([b, h, 0])
    window_kind: str
    window: int

    @property
    def sinks(self) -> int:
        return self.sink_keys.shape[2]

    @property
    def sparse_cache(self) -> int:
        return self.sparse_keys.shape[2]

    @classmethod
    def init(
        cls,
        batch_size: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        feature_dim: int,
        *,
        window: int,
        window_kind: str = "sliding",
        recall: RecallSettings = RecallSettings(),
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        linear_state: bool = True,
    ) -> "HybridRecurrentState":
        """Empty state. ``feature_dim`` is the feature map's output size F; ``dtype`` that of k, v
        (S, z and the errors are kept in at least float32 so long histories do not lose precision).
        ``linear_state=False``: S, z of width 0 (a layer whose linear terms weigh 0)."""
        size = get_window_kind(window_kind).buffer_size(window)
        state_dtype = compute_dtype_for(dtype)
        b, g, h, S, M = batch_size, n_kv_heads, n_heads, recall.sinks, recall.sparse_cache
        kv = dict(dtype=dtype, device=device)
        acc = dict(dtype=state_dtype, device=device)
        scored = feature_dim if M else 0
        linear = feature_dim if linear_state else 0
        return cls(
            keys=torch.zeros(b, g, size, head_dim, **kv),
            values=torch.zeros(b, g, size, head_dim, **kv),
            positions=torch.full((b, size), -1, dtype=torch.long, device=device),
            valid=torch.zeros(b, size, dtype=torch.bool, device=device),
            kv_state=torch.zeros(b, h, linear, head_dim, **acc),
            k_state=torch.zeros(b, h, linear, **acc),
            num_tokens=torch.zeros(b, dtype=torch.long, device=device),
            sink_keys=torch.zeros(b, g, S, head_dim, **kv),
            sink_values=torch.zeros(b, g, S, head_dim, **kv),
            sparse_keys=torch.zeros(b, g, M, head_dim, **kv),
            sparse_values=torch.zeros(b, g, M, head_dim, **kv),
            sparse_scores=torch.zeros(b, g, M, **acc),
            sparse_positions=torch.full((b, g, M), -1, dtype=torch.long, device=device),
            score_kv=torch.zeros(b, h, scored, head_dim, **acc),
            score_k=torch.zeros(b, h, scored, **acc),
            window_kind=window_kind,
            window=window,
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def with_tensors(self, **tensors: torch.Tensor) -> "HybridRecurrentState":
        """A copy with some tensors replaced (window settings kept)."""
        return replace(self, **tensors)

    def nbytes(self) -> int:
        """Total bytes of the state's tensors (independent of how many tokens were seen)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def select_batch(self, index: torch.Tensor) -> "HybridRecurrentState":
        """Rows ``index`` of the state (beam search reordering, dropping finished rows)."""
        return self.with_tensors(**{name: t.index_select(0, index.to(t.device)) for name, t in self.tensors().items()})


def _compact(x: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """x ``[b, heads, n, d]`` with real tokens first (``order`` from ``compaction_order``; None = as is)."""
    return x if order is None else x.gather(2, order[:, None, :, None].expand(x.shape))


def recall_scores(
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    *,
    feature_map_k: FeatureMapFn,
    n_heads: int,
    sinks: int,
    chunk: int = 64,
) -> torch.Tensor:
    """Recall error ``e_i`` of every key (``hybrid_common``), ``[b, g, n]`` in the compute dtype, O(n).

    k, v ``[b, g, n, dh]``; entries at padded positions are 0. ``S_{<i}`` is a causal linear
    attention with ``phi_k(k_i)`` as the query: per-chunk sums, an exclusive prefix over chunks and a
    strictly lower-triangular product inside each chunk.
    """
    b, g, n, dh = k.shape
    r = n_heads // g
    dtype = compute_dtype_for(k.dtype)
    order = compaction_order(key_padding_mask) if key_padding_mask is not None else None
    counts = key_padding_mask.sum(-1) if key_padding_mask is not None else torch.full((b,), n, device=k.device)
    m = -(-n // chunk)
    k_c = F.pad(_compact(k.to(dtype), order), (0, 0, 0, m * chunk - n))
    v_c = F.pad(_compact(v.to(dtype), order), (0, 0, 0, m * chunk - n))
    index = torch.arange(m * chunk, device=k.device)
    stored = (index >= sinks) & (index < counts[:, None])  # [b, N]: keys that enter S_{<i}
    k_h, v_h = k_c.repeat_interleave(r, dim=1), v_c.repeat_interleave(r, dim=1)  # [b, h, N, dh]
    phi = feature_map_k(k_h)  # [b, h, N, F]
    phi_in = (phi * stored[:, None, :, None]).view(b, n_heads, m, chunk, -1)
    phi, v_h = phi.view(b, n_heads, m, chunk, -1), v_h.view(b, n_heads, m, chunk, dh)
    chunk_kv = torch.einsum("bhmcf,bhmcd->bhmfd", phi_in, v_h)
    before_kv = chunk_kv.cumsum(dim=2) - chunk_kv  # [b, h, m, F, dh]: chunks < j
    before_k = phi_in.sum(dim=3).cumsum(dim=2) - phi_in.sum(dim=3)  # [b, h, m, F]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril(-1)  # j < i inside the chunk
    inner = torch.einsum("bhmaf,bhmcf->bhmac", phi, phi_in) * lower
    error = recall_error(phi, v_h, before_kv, before_k, inner @ v_h, inner.sum(dim=-1))  # [b, h, m, C]
    error = error.reshape(b, g, r, m * chunk)[..., :n].sum(dim=2)  # [b, g, n]
    if order is not None:
        error = error.gather(2, torch.argsort(order, dim=-1)[:, None, :].expand(b, g, n))
        error = error * key_padding_mask[:, None, :]
    return error


def prefill_state(
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    *,
    feature_map_k: FeatureMapFn,
    n_heads: int,
    window: int,
    window_kind: str = "sliding",
    recall: RecallSettings = RecallSettings(),
    scores: torch.Tensor | None = None,
    linear_state: bool = True,
) -> HybridRecurrentState:
    """State after the tokens of ``k, v`` ``[b, g, n, dh]`` (mask ``[b, n]``, True = real); ``scores``: the
    ``recall_scores`` of these keys when the caller has them already (computed here otherwise);
    ``linear_state=False``: S, z of width 0 (``HybridRecurrentState.init``).

    Equals the state that ``hybrid_recurrent_step`` reaches after those tokens: the buffer holds
    ``W_{L-1}`` (window of the last real token, at slots ``i mod s``), the sinks their buffer, the
    sparse cache the ``M`` top-ranked keys that left the window, and ``S, z`` all other older keys
    (sparse slots may be in another order than the stepped state's).
    """
    kind = get_window_kind(window_kind)
    b, g, n, dh = k.shape
    groups = n_heads // g
    dtype = compute_dtype_for(k.dtype)
    size = kind.buffer_size(window)
    S, M = recall.sinks, recall.sparse_cache

    positions = real_token_positions(key_padding_mask, b, n, k.device)  # [b, n]
    last = (positions.amax(dim=-1) if n > 0 else torch.full((b,), -1, device=k.device)).clamp(min=-1)  # [b]
    in_window = kind.contains(last[:, None], positions, window)  # [b, n]
    evicted = (positions >= S) & ~in_window  # [b, n]: left the window, not a sink
    keep = torch.zeros(b, g, n, dtype=torch.bool, device=k.device)
    if M:
        if scores is None:
            scores = recall_scores(k, v, key_padding_mask, feature_map_k=feature_map_k, n_heads=n_heads, sinks=S)
        keep = select_top(scores, positions[:, None, :].expand(b, g, n), evicted[:, None, :].expand(b, g, n), M)
    in_linear = (evicted[:, None, :] & ~keep).repeat_interleave(groups, dim=1)  # [b, h, n]

    k_heads = k.to(dtype).repeat_interleave(groups, dim=1)  # [b, h, n, dh]
    v_heads = v.to(dtype).repeat_interleave(groups, dim=1)
    phi_all = feature_map_k(k_heads)  # [b, h, n, F]
    state = HybridRecurrentState.init(b, n_heads, g, dh, phi_all.shape[-1], window=window, window_kind=window_kind,
                                      recall=recall, dtype=k.dtype, device=k.device, linear_state=linear_state)
    tensors = {}
    if linear_state:
        phi_k = phi_all * in_linear[..., None]
        tensors.update(kv_state=torch.einsum("bhnf,bhnd->bhfd", phi_k, v_heads), k_state=phi_k.sum(dim=2))
    order = compaction_order(key_padding_mask) if key_padding_mask is not None else None

    def gather_real(x: torch.Tensor, real_index: torch.Tensor, keep_slot: torch.Tensor) -> torch.Tensor:
        """x ``[b, g, n, dh]`` at real-token indices ``real_index [b, t]`` (zeros where not ``keep_slot``)."""
        if n == 0:
            return x.new_zeros(b, g, real_index.shape[1], dh)
        clamped = real_index.clamp(0, n - 1)
        source = clamped if order is None else order.gather(1, clamped)  # original position of the real token
        picked = x.gather(2, source[:, None, :, None].expand(b, g, source.shape[1], dh))
        return torch.where(keep_slot[:, None, :, None], picked, torch.zeros((), dtype=x.dtype, device=x.device))

    # Slot j holds the real token p = j (mod s) among the last s ones: p = last - ((last - j) mod s).
    slots = torch.arange(size, device=k.device)
    slot_pos = last[:, None] - torch.remainder(last[:, None] - slots[None, :], size)  # [b, s]
    slot_valid = kind.contains(last[:, None], slot_pos, window)
    tensors.update(keys=gather_real(k, slot_pos, slot_valid), values=gather_real(v, slot_pos, slot_valid),
                   positions=torch.where(slot_valid, slot_pos, torch.full_like(slot_pos, -1)), valid=slot_valid,
                   num_tokens=last + 1)
    if S:
        sink_pos = torch.arange(S, device=k.device).expand(b, S)
        sink_real = sink_pos <= last[:, None]
        tensors.update(sink_keys=gather_real(k, sink_pos, sink_real), sink_values=gather_real(v, sink_pos, sink_real))
    if M:
        phi_evicted = phi_all * evicted[:, None, :, None]
        tensors.update(score_kv=torch.einsum("bhnf,bhnd->bhfd", phi_evicted, v_heads), score_k=phi_evicted.sum(dim=2))
        taken = min(n, M)
        chosen = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., :taken]  # [b, g, t] kept first
        chosen_ok = keep.gather(2, chosen)
        chosen_pos = positions[:, None, :].expand(b, g, n).gather(2, chosen)
        pick = chosen[..., None].expand(b, g, taken, dh)
        zero = torch.zeros((), dtype=k.dtype, device=k.device)
        sparse_keys, sparse_values = state.sparse_keys.clone(), state.sparse_values.clone()
        sparse_keys[:, :, :taken] = torch.where(chosen_ok[..., None], k.gather(2, pick), zero)
        sparse_values[:, :, :taken] = torch.where(chosen_ok[..., None], v.gather(2, pick), zero)
        sparse_scores, sparse_positions = state.sparse_scores.clone(), state.sparse_positions.clone()
        sparse_scores[:, :, :taken] = torch.where(chosen_ok, scores.gather(2, chosen), 0.0)
        sparse_positions[:, :, :taken] = torch.where(chosen_ok, chosen_pos, -1)
        tensors.update(sparse_keys=sparse_keys, sparse_values=sparse_values, sparse_scores=sparse_scores,
                       sparse_positions=sparse_positions)
    return state.with_tensors(**tensors)
