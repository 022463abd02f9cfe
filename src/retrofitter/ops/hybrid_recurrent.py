"""Recurrent (decode) execution of the LoLCATs hybrid attention: constant memory per token.

State per batch row (``s`` = ring-buffer size: ``w`` for sliding, ``2t`` for terraced windows):

* ring buffer of the window's keys/values ``[b, g, s, dh]`` (input dtype), the real-token index
  of each slot ``[b, s]`` (-1 = empty) and its validity ``[b, s]``;
* ``S = sum phi_k(k_i) v_i^T`` ``[b, h, F, dh]`` and ``z = sum phi_k(k_i)`` ``[b, h, F]`` over the
  keys that left the window (per *query* head, because the feature maps are per query head);
* ``num_tokens`` ``[b]``: real tokens seen so far (= real-token index of the next token).

One step with a new token at real index ``L`` (the same math as ``hybrid_naive``):

1. evict every buffered key with ``i not in W_L`` into ``S, z`` (windows are monotone, so a key
   leaves once: ``L - w`` for sliding windows; for terraced ones a whole tile leaves when ``L``
   starts a new tile). ``WindowKind.eviction_slots`` says which slots can be concerned;
2. write ``k_L, v_L`` into slot ``L mod s`` (its previous occupant ``L - s`` was just evicted);
3. ``y_L = (sum_{W_L} gamma e^{q.k/sqrt(d) - c_L} v + lam phi_q(q)^T S) / (sum gamma e^{...} + lam phi_q(q)^T z)``
   with ``c_L`` the exact window max (the window is in the buffer).

Rows whose token is not valid (``valid_t`` False, e.g. left padding fed step by step) keep their
state unchanged and output zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from .hybrid_common import (
    FeatureMapFn,
    compaction_order,
    compute_dtype_for,
    get_linear_weight,
    get_window_kind,
    real_token_positions,
)

__all__ = ["HybridRecurrentState", "hybrid_recurrent_step", "prefill_state"]


@dataclass
class HybridRecurrentState:
    """Decode cache of one hybrid attention layer (see module docstring for the meaning of fields)."""

    keys: torch.Tensor  # [b, g, s, dh]
    values: torch.Tensor  # [b, g, s, dh]
    positions: torch.Tensor  # [b, s] long, real-token index per slot, -1 = empty
    valid: torch.Tensor  # [b, s] bool
    kv_state: torch.Tensor  # S: [b, h, F, dh]
    k_state: torch.Tensor  # z: [b, h, F]
    num_tokens: torch.Tensor  # [b] long
    window_kind: str
    window: int

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
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> "HybridRecurrentState":
        """Empty state. ``feature_dim`` is the feature map's output size F; ``dtype`` that of k, v
        (S, z are kept in at least float32 so long histories do not lose precision)."""
        size = get_window_kind(window_kind).buffer_size(window)
        state_dtype = compute_dtype_for(dtype)
        return cls(
            keys=torch.zeros(batch_size, n_kv_heads, size, head_dim, dtype=dtype, device=device),
            values=torch.zeros(batch_size, n_kv_heads, size, head_dim, dtype=dtype, device=device),
            positions=torch.full((batch_size, size), -1, dtype=torch.long, device=device),
            valid=torch.zeros(batch_size, size, dtype=torch.bool, device=device),
            kv_state=torch.zeros(batch_size, n_heads, feature_dim, head_dim, dtype=state_dtype, device=device),
            k_state=torch.zeros(batch_size, n_heads, feature_dim, dtype=state_dtype, device=device),
            num_tokens=torch.zeros(batch_size, dtype=torch.long, device=device),
            window_kind=window_kind,
            window=window,
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def nbytes(self) -> int:
        """Total bytes of the state's tensors (independent of how many tokens were seen)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def select_batch(self, index: torch.Tensor) -> "HybridRecurrentState":
        """Rows ``index`` of the state (beam search reordering, dropping finished rows)."""
        picked = {name: t.index_select(0, index.to(t.device)) for name, t in self.tensors().items()}
        return HybridRecurrentState(**picked, window_kind=self.window_kind, window=self.window)


def prefill_state(
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    *,
    feature_map_k: FeatureMapFn,
    n_heads: int,
    window: int,
    window_kind: str = "sliding",
) -> HybridRecurrentState:
    """State after the tokens of ``k, v`` ``[b, g, n, dh]`` (mask ``[b, n]``, True = real).

    Equals the state that ``hybrid_recurrent_step`` reaches after those tokens: the buffer holds
    ``W_{L-1}`` (window of the last real token, at slots ``i mod s``) and ``S, z`` all older keys.
    """
    kind = get_window_kind(window_kind)
    b, g, n, dh = k.shape
    groups = n_heads // g
    dtype = compute_dtype_for(k.dtype)
    size = kind.buffer_size(window)

    positions = real_token_positions(key_padding_mask, b, n, k.device)  # [b, n]
    last = (positions.amax(dim=-1) if n > 0 else torch.full((b,), -1, device=k.device)).clamp(min=-1)  # [b]
    in_window = kind.contains(last[:, None], positions, window)  # [b, n]
    in_linear = (positions >= 0) & ~in_window

    k_heads = k.to(dtype).repeat_interleave(groups, dim=1)  # [b, h, n, dh]
    v_heads = v.to(dtype).repeat_interleave(groups, dim=1)
    phi_k = feature_map_k(k_heads) * in_linear[:, None, :, None]  # [b, h, n, F]
    kv_state = torch.einsum("bhnf,bhnd->bhfd", phi_k, v_heads)
    k_state = phi_k.sum(dim=2)

    # Slot j holds the real token p = j (mod s) among the last s ones: p = last - ((last - j) mod s).
    slots = torch.arange(size, device=k.device)
    slot_pos = last[:, None] - torch.remainder(last[:, None] - slots[None, :], size)  # [b, s]
    slot_valid = kind.contains(last[:, None], slot_pos, window)
    order = compaction_order(key_padding_mask) if key_padding_mask is not None else None
    if n == 0:
        source = torch.zeros_like(slot_pos)
    elif order is None:
        source = slot_pos.clamp(0, n - 1)
    else:
        source = order.gather(1, slot_pos.clamp(0, n - 1))  # original position of real token p
    index = source[:, None, :, None].expand(b, g, size, dh)
    keep = slot_valid[:, None, :, None]
    keys = torch.where(keep, k.gather(2, index), torch.zeros((), dtype=k.dtype, device=k.device))
    values = torch.where(keep, v.gather(2, index), torch.zeros((), dtype=v.dtype, device=v.device))
    return HybridRecurrentState(
        keys=keys,
        values=values,
        positions=torch.where(slot_valid, slot_pos, torch.full_like(slot_pos, -1)),
        valid=slot_valid,
        kv_state=kv_state,
        k_state=k_state,
        num_tokens=last + 1,
        window_kind=window_kind,
        window=window,
    )


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

    # 1. Evict keys that are no longer in the new token's window into S, z. Only the candidate
    #    slots (1 for sliding, t for terraced) go through phi_k, not the whole buffer.
    size = state.positions.shape[1]
    slots = kind.eviction_slots(new_pos, state.window)  # [b, e]
    slot_pos = state.positions.gather(1, slots)
    leaving = state.valid.gather(1, slots) & ~kind.contains(new_pos[:, None], slot_pos, state.window)
    leaving = leaving & valid_t[:, None]  # [b, e]
    # A terraced window evicts a whole tile once every `window` tokens and nothing in between: skip
    # phi_k and the state update when no slot leaves (on CPU; on an accelerator the bool() would
    # stall the launch queue once per layer, and the masked update below is exact anyway; under
    # torch.compile the data-dependent branch would break the graph, so the masked update runs too).
    evicted_any = q_t.device.type != "cpu" or torch.compiler.is_compiling() or bool(leaving.any())
    if evicted_any:
        index = slots[:, None, :, None].expand(b, g, slots.shape[1], dh)
        k_out = state.keys.gather(2, index).to(dtype).repeat_interleave(groups, dim=1)  # [b, h, e, dh]
        v_out = state.values.gather(2, index).to(dtype).repeat_interleave(groups, dim=1)
        phi_out = feature_map_k(k_out) * leaving[:, None, :, None]  # [b, h, e, F]
        kv_state = state.kv_state + torch.einsum("bhef,bhed->bhfd", phi_out, v_out)
        k_state = state.k_state + phi_out.sum(dim=2)
        evict = torch.zeros_like(state.valid).scatter(1, slots, leaving)  # [b, s]
    else:
        kv_state, k_state = state.kv_state, state.k_state  # never modified in place: sharing is safe
        evict = torch.zeros_like(state.valid)

    # 2. Clear evicted slots (keeps the state canonical: equal to prefill_state's), then write
    #    the new key/value into slot L mod s.
    slot = new_pos % size  # [b]
    write = (torch.arange(size, device=q_t.device)[None, :] == slot[:, None]) & valid_t[:, None]
    keys, values = state.keys, state.values
    if evicted_any:
        zero = torch.zeros((), dtype=state.keys.dtype, device=q_t.device)
        keys = torch.where(evict[:, None, :, None], zero, keys)
        values = torch.where(evict[:, None, :, None], zero, values)
    # One scatter per buffer (a new tensor; the input state stays intact); padded rows rewrite the
    # slot's current content.
    slot_index = slot[:, None, None, None].expand(b, g, 1, dh)
    row_valid = valid_t[:, None, None, None]
    keys = keys.scatter(2, slot_index, torch.where(row_valid, k_t.to(keys.dtype), keys.gather(2, slot_index)))
    values = values.scatter(2, slot_index, torch.where(row_valid, v_t.to(values.dtype), values.gather(2, slot_index)))
    positions = torch.where(evict, -1, state.positions)
    positions = torch.where(write, new_pos[:, None], positions)
    valid = (state.valid & ~evict) | write

    # 3. Output: softmax over the buffered window (exact c_L) + linear history.
    q_c = q_t.to(dtype)
    k_win = keys.to(dtype).repeat_interleave(groups, dim=1)
    v_win = values.to(dtype).repeat_interleave(groups, dim=1)
    in_window = valid & kind.contains(new_pos[:, None], positions, state.window)  # [b, s]
    softmax_keys = in_window | ~valid_t[:, None]  # invalid rows: any finite value, zeroed below
    logits = torch.einsum("bhqd,bhsd->bhqs", q_c, k_win) * scale
    logits = logits.masked_fill(~softmax_keys[:, None, None, :], float("-inf"))
    gamma_c = gamma.to(dtype).view(1, h, 1, 1)
    weights = gamma_c * torch.exp(logits - logits.amax(dim=-1, keepdim=True))  # [b, h, 1, s]
    lam = lam_of(gamma.to(dtype)).view(1, h, 1, 1)
    phi_q = feature_map_q(q_c)  # [b, h, 1, F]
    numerator = weights @ v_win + lam * (phi_q @ kv_state)
    denominator = weights.sum(dim=-1, keepdim=True) + lam * (phi_q @ k_state.unsqueeze(-1))
    y = numerator / denominator
    y = torch.where(valid_t[:, None, None, None], y, torch.zeros_like(y)).to(q_t.dtype)

    new_state = HybridRecurrentState(
        keys=keys,
        values=values,
        positions=positions,
        valid=valid,
        kv_state=kv_state,
        k_state=k_state,
        num_tokens=new_pos + valid_t.long(),
        window_kind=state.window_kind,
        window=state.window,
    )
    return y, new_state
