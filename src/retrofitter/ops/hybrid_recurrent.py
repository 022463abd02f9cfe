"""Recurrent (decode) execution of the LoLCATs hybrid attention: constant memory per token.

The state (``hybrid_state.HybridRecurrentState``): window ring buffer, sinks, sparse cache, ``S, z``.
One step with a new token at real index ``L`` (the same math as ``hybrid_naive``):

1. the buffered keys with ``i not in W_L`` leave the window (windows are monotone, so a key leaves
   once: ``L - w`` for sliding windows; for terraced ones a whole tile leaves when ``L`` starts a
   new tile; ``WindowKind.eviction_slots`` says which slots can be concerned). A sink stays in its
   buffer. Without a sparse cache the others go into ``S, z``. With one, each gets its recall error
   against ``S_all`` (plus the earlier keys leaving in the same step), joins ``S_all``, and competes
   with the cached keys: the ``M`` ranked first stay cached, the rest go into ``S, z``;
2. ``k_L, v_L`` go into slot ``L mod s`` (its previous occupant ``L - s`` just left), and into sink
   slot ``L`` when ``L < sinks``;
3. ``y_L = (sum_E gamma e^{q.k/sqrt(d) - c_L} v + lam phi_q(q)^T S) / (sum_E gamma e^{...} + lam phi_q(q)^T z)``
   over the exact keys ``E`` = window, sinks outside it, cached keys; ``c_L`` their exact max.

Rows whose token is not valid (``valid_t`` False, e.g. left padding fed step by step) keep their
state unchanged and output zeros.
"""

from __future__ import annotations

import math

import torch

from .hybrid_common import FeatureMapFn, get_linear_weight, get_window_kind, recall_error, select_top
from .hybrid_state import HybridRecurrentState, prefill_state

__all__ = ["HybridRecurrentState", "hybrid_recurrent_step", "prefill_state"]


def _fold(kv_state, k_state, keys, values, mask, feature_map_k: FeatureMapFn, groups: int):
    """``S + sum phi_k(k) v^T``, ``z + sum phi_k(k)`` over keys ``[b, g, e, dh]`` where ``mask [b, g, e]``."""
    dtype = kv_state.dtype
    k_h = keys.to(dtype).repeat_interleave(groups, dim=1)  # [b, h, e, dh]
    v_h = values.to(dtype).repeat_interleave(groups, dim=1)
    phi = feature_map_k(k_h) * mask.repeat_interleave(groups, dim=1)[..., None]  # [b, h, e, F]
    return kv_state + torch.einsum("bhef,bhed->bhfd", phi, v_h), k_state + phi.sum(dim=2)


def _sparse_update(state: HybridRecurrentState, k_out, v_out, out_pos, stored, feature_map_k, groups: int) -> dict:
    """Score the keys leaving the window (``k_out, v_out [b, g, e, dh]`` at real indices ``out_pos [b, e]``,
    ``stored [b, e]``), rank them with the cached keys, fold the losers into ``S, z``; new tensors."""
    b, g, e, dh = k_out.shape
    dtype = state.kv_state.dtype
    k_h = k_out.to(dtype).repeat_interleave(groups, dim=1)  # [b, h, e, dh]
    v_h = v_out.to(dtype).repeat_interleave(groups, dim=1)
    phi = feature_map_k(k_h)  # [b, h, e, F]
    earlier = (out_pos[:, None, :] < out_pos[:, :, None]) & stored[:, None, :]  # [b, e(i), e(j)]: j < i joins S_{<i}
    inner = (phi @ phi.transpose(-1, -2)) * earlier[:, None]
    error = recall_error(phi, v_h, state.score_kv, state.score_k, inner @ v_h, inner.sum(dim=-1))  # [b, h, e]
    scores = error.view(b, g, groups, e).sum(dim=2)
    phi_stored = phi * stored[:, None, :, None]
    score_kv = state.score_kv + torch.einsum("bhef,bhed->bhfd", phi_stored, v_h)
    score_k = state.score_k + phi_stored.sum(dim=2)

    M = state.sparse_cache
    cand_k = torch.cat([state.sparse_keys, k_out], dim=2)  # [b, g, M + e, dh]
    cand_v = torch.cat([state.sparse_values, v_out], dim=2)
    cand_score = torch.cat([state.sparse_scores, scores.to(state.sparse_scores.dtype)], dim=2)
    cand_pos = torch.cat([state.sparse_positions, out_pos[:, None, :].expand(b, g, e)], dim=2)
    cand_ok = torch.cat([state.sparse_positions >= 0, stored[:, None, :].expand(b, g, e)], dim=2)
    keep = select_top(cand_score, cand_pos, cand_ok, M)
    kept = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., :M]  # kept ones first, order kept
    kept_ok = keep.gather(2, kept)
    dropped = cand_ok & ~keep  # at most e: the cache held at most M
    lost = torch.argsort((~dropped).to(torch.int8), dim=-1, stable=True)[..., :e]
    zero = torch.zeros((), dtype=cand_k.dtype, device=cand_k.device)

    def take(x, index, ok, empty):
        picked = x.gather(2, index[..., None].expand(*index.shape, x.shape[-1])) if x.dim() == 4 else x.gather(2, index)
        return torch.where(ok[..., None] if x.dim() == 4 else ok, picked, empty)

    kv_state, k_state = _fold(state.kv_state, state.k_state, take(cand_k, lost, dropped.gather(2, lost), zero),
                              take(cand_v, lost, dropped.gather(2, lost), zero), dropped.gather(2, lost),
                              feature_map_k, groups)
    return dict(kv_state=kv_state, k_state=k_state, score_kv=score_kv, score_k=score_k,
                sparse_keys=take(cand_k, kept, kept_ok, zero), sparse_values=take(cand_v, kept, kept_ok, zero),
                sparse_scores=take(cand_score, kept, kept_ok, torch.zeros((), dtype=cand_score.dtype)),
                sparse_positions=take(cand_pos, kept, kept_ok, torch.full((), -1, dtype=torch.long)))


def _write_slot(buffer: torch.Tensor, slot: torch.Tensor, new: torch.Tensor, write: torch.Tensor) -> torch.Tensor:
    """``buffer [b, g, s, dh]`` with ``new [b, g, 1, dh]`` at ``slot [b]`` in rows ``write [b]`` (a new tensor)."""
    b, g, _, dh = buffer.shape
    index = slot[:, None, None, None].expand(b, g, 1, dh)
    return buffer.scatter(2, index, torch.where(write[:, None, None, None], new.to(buffer.dtype), buffer.gather(2, index)))


def hybrid_recurrent_step(
    state: HybridRecurrentState,
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    valid_t: torch.Tensor | None = None,
    *,
    feature_map_q: FeatureMapFn,
    feature_map_k: FeatureMapFn,
    gamma: torch.Tensor,
    linear_weight: str = "one",
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, HybridRecurrentState]:
    """One decode step. q_t ``[b, h, 1, dh]``, k_t/v_t ``[b, g, 1, dh]``, valid_t ``[b]`` bool.

    Returns ``(y_t [b, h, 1, dh] in q_t.dtype, new_state)``; the input state is not modified.
    """
    kind = get_window_kind(state.window_kind)
    lam_of = get_linear_weight(linear_weight)
    b, h, one, dh = q_t.shape
    g = state.keys.shape[1]
    if one != 1 or k_t.shape != (b, g, 1, dh) or v_t.shape != (b, g, 1, dh):
        raise ValueError(
            f"step expects q [b, h, 1, dh] and k, v [b, g={g}, 1, dh]; "
            f"got {tuple(q_t.shape)}, {tuple(k_t.shape)}, {tuple(v_t.shape)}"
        )
    if state.kv_state.shape[:2] != (b, h):
        raise ValueError(f"state is for batch/heads {tuple(state.kv_state.shape[:2])}, query is {(b, h)}")
    groups = h // g
    dtype = state.kv_state.dtype
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(dh)
    if valid_t is None:
        valid_t = torch.ones(b, dtype=torch.bool, device=q_t.device)
    new_pos = state.num_tokens  # [b]: real index of the incoming token
    sinks = state.sinks

    # 1. Keys that leave the new token's window. Only the candidate slots (1 for sliding, t for
    #    terraced) go through phi_k, not the whole buffer.
    size = state.positions.shape[1]
    slots = kind.eviction_slots(new_pos, state.window)  # [b, e]
    slot_pos = state.positions.gather(1, slots)
    leaving = state.valid.gather(1, slots) & ~kind.contains(new_pos[:, None], slot_pos, state.window)
    leaving = leaving & valid_t[:, None]  # [b, e]
    stored = leaving & (slot_pos >= sinks)  # a sink stays in its own buffer
    # A terraced window evicts a whole tile once every `window` tokens and nothing in between: skip
    # phi_k and the state update when no slot leaves (on CPU; on an accelerator the bool() would
    # stall the launch queue once per layer, and the masked update below is exact anyway; under
    # torch.compile the data-dependent branch would break the graph, so the masked update runs too).
    evicted_any = q_t.device.type != "cpu" or torch.compiler.is_compiling() or bool(leaving.any())
    updates: dict[str, torch.Tensor] = {}
    evict = torch.zeros_like(state.valid)
    if evicted_any:
        index = slots[:, None, :, None].expand(b, g, slots.shape[1], dh)
        k_out, v_out = state.keys.gather(2, index), state.values.gather(2, index)  # [b, g, e, dh]
        if state.sparse_cache:
            updates = _sparse_update(state, k_out, v_out, slot_pos, stored, feature_map_k, groups)
        else:
            kv_state, k_state = _fold(state.kv_state, state.k_state, k_out, v_out, stored[:, None].expand(b, g, -1),
                                      feature_map_k, groups)
            updates = dict(kv_state=kv_state, k_state=k_state)
        evict = evict.scatter(1, slots, leaving)  # [b, s]

    # 2. Clear evicted slots (keeps the state canonical: equal to prefill_state's), then write
    #    the new key/value into slot L mod s (a new tensor; the input state stays intact).
    slot = new_pos % size  # [b]
    write = (torch.arange(size, device=q_t.device)[None, :] == slot[:, None]) & valid_t[:, None]
    keys, values = state.keys, state.values
    if evicted_any:
        zero = torch.zeros((), dtype=state.keys.dtype, device=q_t.device)
        keys = torch.where(evict[:, None, :, None], zero, keys)
        values = torch.where(evict[:, None, :, None], zero, values)
    keys, values = _write_slot(keys, slot, k_t, valid_t), _write_slot(values, slot, v_t, valid_t)
    positions = torch.where(evict, -1, state.positions)
    positions = torch.where(write, new_pos[:, None], positions)
    valid = (state.valid & ~evict) | write
    updates.update(keys=keys, values=values, positions=positions, valid=valid, num_tokens=new_pos + valid_t.long())
    if sinks:
        sink_write = valid_t & (new_pos < sinks)
        sink_slot = new_pos.clamp(max=sinks - 1)
        updates.update(sink_keys=_write_slot(state.sink_keys, sink_slot, k_t, sink_write),
                       sink_values=_write_slot(state.sink_values, sink_slot, v_t, sink_write))
    new_state = state.with_tensors(**updates)

    # 3. Output: softmax over window + sinks + sparse cache (exact c_L) + linear history.
    sink_pos = torch.arange(sinks, device=q_t.device).expand(b, sinks)
    sink_seen = (sink_pos <= new_pos[:, None]) & ~kind.contains(new_pos[:, None], sink_pos, state.window)
    exact = torch.cat([valid & kind.contains(new_pos[:, None], positions, state.window), sink_seen], dim=1)  # [b, s+S]
    exact_k = torch.cat([new_state.keys, new_state.sink_keys, new_state.sparse_keys], dim=2)  # [b, g, s+S+M, dh]
    exact_v = torch.cat([new_state.values, new_state.sink_values, new_state.sparse_values], dim=2)
    exact = torch.cat([exact[:, None].expand(b, g, -1), new_state.sparse_positions >= 0], dim=2)  # [b, g, s+S+M]
    exact = exact.repeat_interleave(groups, dim=1) | ~valid_t[:, None, None]  # invalid rows: any finite value
    q_c = q_t.to(dtype)
    logits = torch.einsum("bhqd,bhsd->bhqs", q_c, exact_k.to(dtype).repeat_interleave(groups, dim=1)) * scale
    logits = logits.masked_fill(~exact[:, :, None, :], float("-inf"))
    gamma_c = gamma.to(dtype).view(1, h, 1, 1)
    weights = gamma_c * torch.exp(logits - logits.amax(dim=-1, keepdim=True))  # [b, h, 1, s+S+M]
    lam = lam_of(gamma.to(dtype)).view(1, h, 1, 1)
    phi_q = feature_map_q(q_c)  # [b, h, 1, F]
    numerator = weights @ exact_v.to(dtype).repeat_interleave(groups, dim=1) + lam * (phi_q @ new_state.kv_state)
    denominator = weights.sum(dim=-1, keepdim=True) + lam * (phi_q @ new_state.k_state.unsqueeze(-1))
    y = numerator / denominator
    y = torch.where(valid_t[:, None, None, None], y, torch.zeros_like(y)).to(q_t.dtype)
    return y, new_state
