"""One decode step's attention over a cache split along the keys (flash-decoding), for CPU.

A decode step of MLA's absorbed attention is one query head of q rows (its h heads) over one shared key
[b, 1, N, D]: the fused CPU kernel parallelises over batch × heads × query blocks, here 1 × 1 × 1, so it runs on
one thread. Split the first N' = s·⌊N/s⌋ keys into s equal stretches and run them as s heads of the same q rows,
which the kernel spreads over its threads (a view of the cache, no copy), each with its log-sum-exp ℓ_t [b, s, q];
the last N − N' < s keys (if any) are one more, small, stretch computed directly. Then

    out = Σ_t softmax_t(ℓ_t) · out_t                                  (the exact softmax over all N keys)

Masked keys take the dtype's lowest finite value (not −inf), so a stretch with every key masked has ℓ ≈ that value
and weight 0. Reference: ``decode_attention_naive``; tests/ops/test_decode_attention.py compares them in float64.
"""

from __future__ import annotations

import torch

__all__ = ["split_kv_decode_attention"]


def _additive(mask: torch.Tensor | None, batch: int, total: int, dtype, device) -> torch.Tensor:
    """The mask as additive [b, N] in ``dtype`` (lowest finite value where masked)."""
    lowest = torch.finfo(dtype).min
    if mask is None:
        return torch.zeros(batch, total, dtype=dtype, device=device)
    mask = mask[..., :total].reshape(mask.shape[0], total).expand(batch, total)
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, lowest)
    return mask.to(dtype).clamp(min=lowest)


def split_kv_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                              scale: float, splits: int) -> torch.Tensor:
    """query [b, 1, q, D], key and value [b, 1, N, D] (the CPU kernel takes equal widths: a view of the key serves as
    the value), mask [b | 1, 1, 1, N] bool (True: allowed) or additive, or None → [b, 1, q, D]."""
    batch, _, rows, width = query.shape
    total = key.shape[2]
    splits = max(1, min(int(splits), total))
    length = total // splits                                                 # N'/s
    main = splits * length                                                   # N'
    additive = _additive(mask, batch, total, query.dtype, query.device)     # [b, N]

    def stretches(x: torch.Tensor) -> torch.Tensor:                          # [b, 1, N, ·] -> [b, s, N'/s, ·], a view
        return x[:, 0, :main].view(x.shape[0], splits, length, x.shape[-1])

    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query.expand(batch, splits, rows, width), stretches(key), stretches(value), scale=scale,
        attn_mask=additive[:, :main].view(batch, splits, 1, length))[:2]   # [b, s, q, D], [b, s, q]
    if main < total:  # the last N − N' keys
        scores = (query @ key[:, :, main:].transpose(-1, -2)) * scale + additive[:, None, None, main:]  # [b, 1, q, r]
        lse = torch.cat([lse, torch.logsumexp(scores, -1)], 1)              # [b, s + 1, q]
        out = torch.cat([out, torch.softmax(scores, -1) @ value[:, :, main:]], 1)
    weights = torch.softmax(lse.to(torch.promote_types(lse.dtype, torch.float32)), 1).to(out.dtype).unsqueeze(-1)
    return (out * weights).sum(1, keepdim=True)                              # [b, 1, q, D]
