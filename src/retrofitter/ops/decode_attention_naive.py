"""Reference of one decode step's attention over a cache (the definition ``decode_attention`` must match).

For the q query rows of one step against the N cached keys of one shared key head (multi-query, as MLA's absorbed
decode step, whose h heads are the rows):

    out_i = Σ_j softmax_j(scale · q_i·k_j + m_j) v_j          q [b, 1, q, D], k [b, 1, N, D], v [b, 1, N, Dv]

with m the additive mask [b, 1, 1, N] (0 where allowed) or a boolean one (True where allowed). The softmax is
taken in at least float32. Memory O(b q N): for tests.
"""

from __future__ import annotations

import torch

__all__ = ["decode_attention_naive"]


def decode_attention_naive(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                           scale: float) -> torch.Tensor:
    """[b, 1, q, Dv] (module docstring)."""
    scores = (query @ key.transpose(-1, -2)) * scale                         # [b, 1, q, N]
    if mask is not None:
        lowest = torch.finfo(scores.dtype).min
        scores = scores.masked_fill(~mask, lowest) if mask.dtype == torch.bool else scores + mask.clamp(min=lowest)
    weights = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), -1)
    return (weights.to(value.dtype) @ value)
