"""Cut a text into fixed-length token blocks for calibration and perplexity.

The whole text is tokenized once, without special tokens, into ids ``t_0 .. t_{T-1}``. With a
BOS token (``prepend_bos`` and ``tokenizer.bos_token_id`` not None) block ``i`` is
``[bos] + t[i*(L-1) : (i+1)*(L-1)]``, otherwise ``t[i*L : (i+1)*L]``, for ``L = seq_len``:
windows never overlap and the tail shorter than a window is dropped. Result: LongTensor [n, L].
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["token_blocks", "calibration_blocks", "tokenize_text", "with_repeated_spans"]


def tokenize_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (HF ``encode`` API)."""
    # verbose=False: HF warns when a sequence exceeds model_max_length, which is expected here.
    return list(tokenizer.encode(text, add_special_tokens=False, verbose=False))


def token_blocks(
    tokenizer: Any,
    text: str,
    seq_len: int,
    max_blocks: int | None = None,
    max_tokens: int | None = None,
    prepend_bos: bool = True,
) -> torch.LongTensor:
    """Non-overlapping token windows of ``text``: LongTensor [n, seq_len].

    ``max_blocks`` caps n; ``max_tokens`` caps the total n * seq_len (BOS included). Raises
    ValueError when the text is too short for one block or a limit allows no block at all.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if max_blocks is not None and max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1 (or None), got {max_blocks}")
    if max_tokens is not None and max_tokens < seq_len:
        raise ValueError(f"max_tokens={max_tokens} is smaller than one block of seq_len={seq_len}")
    bos_id = getattr(tokenizer, "bos_token_id", None) if prepend_bos else None
    text_per_block = seq_len - 1 if bos_id is not None else seq_len
    if text_per_block < 1:
        raise ValueError(f"seq_len={seq_len} leaves no room for text after the BOS token; use seq_len >= 2")
    ids = tokenize_text(tokenizer, text)
    n_blocks = len(ids) // text_per_block
    if n_blocks == 0:
        raise ValueError(f"text has {len(ids)} tokens, fewer than one block needs "
                         f"({text_per_block} text tokens for seq_len={seq_len})")
    if max_blocks is not None:
        n_blocks = min(n_blocks, max_blocks)
    if max_tokens is not None:
        n_blocks = min(n_blocks, max_tokens // seq_len)
    body = torch.tensor(ids[:n_blocks * text_per_block], dtype=torch.long).view(n_blocks, text_per_block)
    if bos_id is None:
        return body
    bos_column = torch.full((n_blocks, 1), int(bos_id), dtype=torch.long)
    return torch.cat([bos_column, body], dim=1)


def calibration_blocks(
    tokenizer: Any,
    text: str,
    seq_len: int,
    n_blocks: int,
    prepend_bos: bool = True,
) -> torch.LongTensor:
    """The first ``n_blocks`` windows of ``text`` ([n_blocks, seq_len]); ValueError if fewer exist.

    Strict on purpose: silently calibrating on fewer samples than asked would change results.
    """
    blocks = token_blocks(tokenizer, text, seq_len, max_blocks=n_blocks, prepend_bos=prepend_bos)
    if blocks.shape[0] < n_blocks:
        raise ValueError(f"the calibration text yields only {blocks.shape[0]} blocks of seq_len={seq_len}, "
                         f"{n_blocks} were requested; lower n_blocks/seq_len or use a longer corpus")
    return blocks


def with_repeated_spans(blocks: torch.Tensor, share: float, span: int, seed: int = 0) -> torch.LongTensor:
    """Retrieval-shaped calibration: a copy of ``blocks`` [n, L] in which ``round(share · n)`` evenly spaced blocks
    end with a repeat of one of their own earlier spans.

    In a chosen block b the last ``m = min(span, (L - 1) // 4)`` tokens become ``b[a : a + m]``, ``a`` drawn
    uniformly from ``1 .. L - 2m`` (never position 0, the BOS if there is one; the source ends before the repeat
    starts), so the distance between a token and its earlier copy is L - m - a, between m and L - m - 1. Reading the
    repeat, a model's copying (induction) heads attend back across that distance: the attention that passkey
    retrieval needs, which plain prose seldom asks for. Deterministic in ``seed``; the other blocks are unchanged.
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"the share of blocks with a repeated span must lie in [0, 1], got {share}")
    n, length = blocks.shape
    m = min(span, (length - 1) // 4)
    chosen = round(share * n)
    if chosen and m < 1:
        raise ValueError(f"blocks of {length} tokens are too short for a repeated span (at least 5 tokens)")
    out = blocks.clone()
    if chosen == 0:
        return out
    generator = torch.Generator().manual_seed(seed)
    rows = torch.linspace(0, n - 1, chosen).round().long().unique()  # evenly spaced, first and last included
    starts = torch.randint(1, length - 2 * m + 1, (len(rows),), generator=generator)
    for row, start in zip(rows.tolist(), starts.tolist()):
        out[row, length - m:] = blocks[row, start:start + m]
    return out
