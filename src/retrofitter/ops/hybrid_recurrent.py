"""Recurrent (decode) execution of the LoLCATs hybrid attention: constant memory per token.

The state (``hybrid_state.HybridRecurrentState``): window ring buffer, sinks, sparse cache, ``S, z``.
One step with a new token at real index ``L`` (the same math as ``hybrid_naive``):

1. the buffered keys with ``i not in W_L`` leave the window (windows are monotone, so a key leaves
   once: ``L - w`` for sliding windows; for terraced ones a whole tile leaves when ``L`` starts a
   new tile; ``WindowKind.eviction_slots`` says which slots can be concerned). A sink stays in its
   buffer. Without a sparse cache the others go into ``S, z``. With one, each gets its recall error
   against ``S_all`` (plus the earlier keys leaving in the same step), joins ``S_all``, and competes
   with the cached keys: the ``M`` ranked first stay cached, the rest go into ``S, z`` (a sliding window
   sends one key a step: it replaces the cache's last-ranked entry if it outranks it). A layer
   without a linear part (``linear_weight="zero"``) keeps no ``S, z`` and folds nothing;
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

from .hybrid_common import FeatureMapFn, get_linear_weight, get_window_kind, outranks, recall_error, select_top
from .hybrid_state import HybridRecurrentState, prefill_state

__all__ = ["HybridRecurrentState", "hybrid_recurrent_step", "prefill_state"]


def _fold(kv_state, k_state, keys, values, mask, feature_map_k: FeatureMapFn, groups: int):
    """``S + sum phi_k(k) v^T``, ``z + sum phi_k(k)`` over keys ``[b, g, e, dh]`` where ``mask [b, g, e]``."""
    dtype = kv_state.dtype
    k_h = keys.to(dtype).repeat_interleave(groups, dim=1)  # [b, h, e, dh]
    v_h = values.to(dtype).repeat_interleave(groups, dim=1)
    phi = feature_map_k(k_h) * mask.repeat_interleave(groups, dim=1)[..., None]  # [b, h, e, F]
    return kv_state + phi.transpose(-1, -2) @ v_h, k_state + phi.sum(dim=2)  # sum_e phi_e v_e^T: [b, h, F, dh]


def _score_leaving(state: HybridRecurrentState, k_out, v_out, out_pos, stored, feature_map_k, groups: int):
    """Recall errors ``[b, g, e]`` of the keys leaving the window (``k_out, v_out [b, g, e, dh]`` at real indices
    ``out_pos [b, e]``, ``stored [b, e]``) against ``S_all`` plus the earlier ones leaving in the same step, and
    ``S_all, z_all`` with them added."""
    b, g, e, dh = k_out.shape
    dtype = state.score_kv.dtype
    k_h = k_out.to(dtype).repeat_interleave(groups, dim=1)  # [b, h, e, dh]
    v_h = v_out.to(dtype).repeat_interleave(groups, dim=1)
    phi = feature_map_k(k_h)  # [b, h, e, F]
    if e == 1:  # one key leaves (sliding windows): nothing else joins S_{<i}
        error = recall_error(phi, v_h, state.score_kv, state.score_k)
    else:
        # [b, e(i), e(j)]: j < i joins S_{<i}
        earlier = (out_pos[:, None, :] < out_pos[:, :, None]) & stored[:, None, :]
        inner = (phi @ phi.transpose(-1, -2)) * earlier[:, None]
        error = recall_error(phi, v_h, state.score_kv, state.score_k, inner @ v_h, inner.sum(dim=-1))  # [b, h, e]
    phi_stored = phi * stored[:, None, :, None]
    score_kv = state.score_kv + phi_stored.transpose(-1, -2) @ v_h  # [b, h, F, dh]
    score_k = state.score_k + phi_stored.sum(dim=2)
    return error.view(b, g, groups, e).sum(dim=2), score_kv, score_k


def _sparse_update(state: HybridRecurrentState, k_out, v_out, out_pos, stored, feature_map_k, groups: int) -> dict:
    """Score the keys leaving the window (``k_out, v_out [b, g, e, dh]`` at real indices ``out_pos [b, e]``,
    ``stored [b, e]``), rank them with the cached keys, fold the losers into ``S, z``; new tensors."""
    b, g, e, dh = k_out.shape
    scores, score_kv, score_k = _score_leaving(state, k_out, v_out, out_pos, stored, feature_map_k, groups)
    linear = state.kv_state.shape[2] > 0  # no S, z to fold the losers into when the layer has no linear part
    if e == 1:
        updates = _replace_last_ranked(state, k_out, v_out, scores, out_pos, stored, feature_map_k, groups, linear)
        return dict(updates, score_kv=score_kv, score_k=score_k)
    M = state.sparse_cache
    cand_k = torch.cat([state.sparse_keys, k_out], dim=2)  # [b, g, M + e, dh]
    cand_v = torch.cat([state.sparse_values, v_out], dim=2)
    cand_score = torch.cat([state.sparse_scores, scores.to(state.sparse_scores.dtype)], dim=2)
    cand_pos = torch.cat([state.sparse_positions, out_pos[:, None, :].expand(b, g, e)], dim=2)
    cand_ok = torch.cat([state.sparse_positions >= 0, stored[:, None, :].expand(b, g, e)], dim=2)
    keep = select_top(cand_score, cand_pos, cand_ok, M)
    kept = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., :M]  # kept ones first, order kept
    kept_ok = keep.gather(2, kept)
    zero = torch.zeros((), dtype=cand_k.dtype, device=cand_k.device)

    def take(x, index, ok, empty):
        picked = x.gather(2, index[..., None].expand(*index.shape, x.shape[-1])) if x.dim() == 4 else x.gather(2, index)
        return torch.where(ok[..., None] if x.dim() == 4 else ok, picked, empty)

    updates = dict(score_kv=score_kv, score_k=score_k,
                   sparse_keys=take(cand_k, kept, kept_ok, zero), sparse_values=take(cand_v, kept, kept_ok, zero),
                   sparse_scores=take(cand_score, kept, kept_ok, torch.zeros((), dtype=cand_score.dtype)),
                   sparse_positions=take(cand_pos, kept, kept_ok, torch.full((), -1, dtype=torch.long)))
    if linear:
        dropped = cand_ok & ~keep  # at most e: the cache held at most M
        lost = torch.argsort((~dropped).to(torch.int8), dim=-1, stable=True)[..., :e]
        lost_ok = dropped.gather(2, lost)
        updates.update(zip(("kv_state", "k_state"), _fold(
            state.kv_state, state.k_state, take(cand_k, lost, lost_ok, zero), take(cand_v, lost, lost_ok, zero),
            lost_ok, feature_map_k, groups)))
    return updates


def _replace_last_ranked(state: HybridRecurrentState, k_out, v_out, scores, out_pos, stored, feature_map_k,
                         groups: int, linear: bool) -> dict:
    """One leaving key (``k_out, v_out [b, g, 1, dh]``, ``scores [b, g, 1]``): the top ``M`` of the ``M + 1``
    candidates are the cache without its last-ranked entry (an empty slot ranks last of all) if the new key
    outranks that entry, else the cache as it is; the new key takes the freed slot. Same set as ``select_top``
    over the candidates (slot order differs, which nothing reads)."""
    b, g, _, dh = k_out.shape
    filled = state.sparse_positions >= 0  # [b, g, M]
    ranked = torch.where(filled, state.sparse_scores, float("-inf"))
    lowest = ranked.amin(dim=-1, keepdim=True)  # [b, g, 1]
    # Among the entries of the lowest score, the earliest ranks last (an empty slot's position is -1).
    ties = torch.where(ranked == lowest, state.sparse_positions, torch.iinfo(torch.long).max)
    slot = ties.argmin(dim=-1, keepdim=True)  # [b, g, 1]
    new_pos = out_pos[:, None, :].expand(b, g, 1)
    new_score = scores.to(state.sparse_scores.dtype)
    enters = stored[:, None, :] & outranks(new_score, new_pos, lowest, ties.gather(2, slot))  # [b, g, 1]
    hit = (torch.arange(filled.shape[-1], device=filled.device) == slot) & enters  # [b, g, M]: the slot taken

    def put(x, new):
        return torch.where(hit[..., None] if x.dim() == 4 else hit, new, x)

    updates = dict(sparse_keys=put(state.sparse_keys, k_out), sparse_values=put(state.sparse_values, v_out),
                   sparse_scores=put(state.sparse_scores, new_score),
                   sparse_positions=put(state.sparse_positions, new_pos))
    if linear:  # the loser: the replaced entry (if it held a key) when the new key enters, else the new key
        vec = slot[..., None].expand(b, g, 1, dh)
        out_k = torch.where(enters[..., None], state.sparse_keys.gather(2, vec), k_out)
        out_v = torch.where(enters[..., None], state.sparse_values.gather(2, vec), v_out)
        lost = torch.where(enters, filled.gather(2, slot), stored[:, None, :])
        updates.update(zip(("kv_state", "k_state"), _fold(state.kv_state, state.k_state, out_k, out_v, lost,
                                                            feature_map_k, groups)))
    return updates


def _write_slot(buffer: torch.Tensor, slot: torch.Tensor, new: torch.Tensor,
                write: torch.Tensor | None) -> torch.Tensor:
    """``buffer [b, g, s, dh]`` with ``new [b, g, 1, dh]`` at ``slot [b]`` in rows ``write [b]`` (None: all rows;
    a new tensor)."""
    b, g, _, dh = buffer.shape
    index = slot[:, None, None, None].expand(b, g, 1, dh)
    if write is not None:
        new = torch.where(write[:, None, None, None], new.to(buffer.dtype), buffer.gather(2, index))
    return buffer.scatter(2, index, new.to(buffer.dtype))


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
    linear = state.kv_state.shape[2] > 0  # S, z kept (width 0 for a layer without a linear part)
    if linear_weight != "zero" and not linear:
        raise ValueError(f"linear_weight {linear_weight!r} needs S, z, but the state was built without a linear part")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(dh)
    all_valid = valid_t is None  # the common decode case: every row's token is real, no masking needed
    if all_valid:
        valid_t = torch.ones(b, dtype=torch.bool, device=q_t.device)
    new_pos = state.num_tokens  # [b]: real index of the incoming token
    sinks = state.sinks

    # 1. Keys that leave the new token's window. Only the candidate slots (1 for sliding, t for
    #    terraced) go through phi_k, not the whole buffer.
    size = state.positions.shape[1]
    slots = kind.eviction_slots(new_pos, state.window)  # [b, e]
    slot_pos = state.positions.gather(1, slots)
    leaving = state.valid.gather(1, slots) & ~kind.contains(new_pos[:, None], slot_pos, state.window)
    leaving = leaving if all_valid else leaving & valid_t[:, None]  # [b, e]
    stored = leaving & (slot_pos >= sinks)  # a sink stays in its own buffer
    # A terraced window evicts a whole tile once every `window` tokens and nothing in between: skip
    # phi_k and the state update when no slot leaves (on CPU; on an accelerator the bool() would
    # stall the launch queue once per layer, and the masked update below is exact anyway; under
    # torch.compile the data-dependent branch would break the graph, so the masked update runs too).
    evicted_any = q_t.device.type != "cpu" or torch.compiler.is_compiling() or bool(leaving.any())
    updates: dict[str, torch.Tensor] = {}
    # Sliding windows with every row real: the leaving key's slot is the one the new key overwrites.
    clear = evicted_any and not (kind.evicts_write_slot and all_valid)
    if evicted_any and (state.sparse_cache or linear):  # else the leaving keys go nowhere (window + sinks only)
        index = slots[:, None, :, None].expand(b, g, slots.shape[1], dh)
        k_out, v_out = state.keys.gather(2, index), state.values.gather(2, index)  # [b, g, e, dh]
        if state.sparse_cache:
            updates = _sparse_update(state, k_out, v_out, slot_pos, stored, feature_map_k, groups)
        elif linear:
            kv_state, k_state = _fold(state.kv_state, state.k_state, k_out, v_out, stored[:, None].expand(b, g, -1),
                                      feature_map_k, groups)
            updates = dict(kv_state=kv_state, k_state=k_state)
    if clear:
        evict = torch.zeros_like(state.valid).scatter(1, slots, leaving)  # [b, s]

    # 2. Clear evicted slots (keeps the state canonical: equal to prefill_state's), then write
    #    the new key/value into slot L mod s (a new tensor; the input state stays intact).
    slot = new_pos % size  # [b]
    write = torch.arange(size, device=q_t.device)[None, :] == slot[:, None]
    write = write if all_valid else write & valid_t[:, None]
    keys, values = state.keys, state.values
    positions, valid = state.positions, state.valid
    if clear:
        zero = torch.zeros((), dtype=state.keys.dtype, device=q_t.device)
        keys = torch.where(evict[:, None, :, None], zero, keys)
        values = torch.where(evict[:, None, :, None], zero, values)
        positions, valid = torch.where(evict, -1, positions), valid & ~evict
    write_t = None if all_valid else valid_t
    keys, values = _write_slot(keys, slot, k_t, write_t), _write_slot(values, slot, v_t, write_t)
    positions = torch.where(write, new_pos[:, None], positions)
    valid = valid | write
    updates.update(keys=keys, values=values, positions=positions, valid=valid,
                   num_tokens=new_pos + (1 if all_valid else valid_t.long()))
    sink_write = valid_t & (new_pos < sinks)
    # Only the first `sinks` tokens write there: skip the copies afterwards (CPU only, as above).
    if sinks and (q_t.device.type != "cpu" or torch.compiler.is_compiling() or bool(sink_write.any())):
        sink_slot = new_pos.clamp(max=sinks - 1)
        updates.update(sink_keys=_write_slot(state.sink_keys, sink_slot, k_t, sink_write),
                       sink_values=_write_slot(state.sink_values, sink_slot, v_t, sink_write))
    new_state = state.with_tensors(**updates)

    # 3. Output: softmax over window + sinks + sparse cache (exact c_L) + linear history. Query heads
    #    as [g, r] (head g * r + j reads kv head g): the exact keys are read once per kv head, not copied.
    sink_pos = torch.arange(sinks, device=q_t.device).expand(b, sinks)
    sink_seen = (sink_pos <= new_pos[:, None]) & ~kind.contains(new_pos[:, None], sink_pos, state.window)
    exact = torch.cat([valid, sink_seen], dim=1)  # [b, s+S]: after 1-2 the buffer holds exactly W_L
    exact_k = torch.cat([new_state.keys, new_state.sink_keys, new_state.sparse_keys], dim=2)  # [b, g, s+S+M, dh]
    exact_v = torch.cat([new_state.values, new_state.sink_values, new_state.sparse_values], dim=2)
    exact = torch.cat([exact[:, None].expand(b, g, -1), new_state.sparse_positions >= 0], dim=2)  # [b, g, s+S+M]
    exact = exact if all_valid else exact | ~valid_t[:, None, None]  # invalid rows: any finite value
    q_c = q_t.to(dtype)
    logits = (q_c.reshape(b, g, groups, dh) @ exact_k.to(dtype).transpose(-1, -2)) * scale  # [b, g, r, s+S+M]
    logits = logits.masked_fill(~exact[:, :, None, :], float("-inf"))
    weights = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    numerator = (weights @ exact_v.to(dtype)).view(b, h, 1, dh)
    denominator = weights.sum(dim=-1).view(b, h, 1, 1)
    if linear_weight != "zero":  # with lam = 0 gamma cancels: y is the plain softmax over the exact keys
        gamma_c = gamma.to(dtype).view(1, h, 1, 1)
        lam = lam_of(gamma.to(dtype)).view(1, h, 1, 1)
        phi_q = feature_map_q(q_c)  # [b, h, 1, F]
        numerator = gamma_c * numerator + lam * (phi_q @ new_state.kv_state)
        denominator = gamma_c * denominator + lam * (phi_q @ new_state.k_state.unsqueeze(-1))
    y = numerator / denominator
    y = y if all_valid else torch.where(valid_t[:, None, None, None], y, torch.zeros_like(y))
    y = y.to(q_t.dtype)
    return y, new_state
