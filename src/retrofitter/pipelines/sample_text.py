"""Text the original model writes: continuations of prompts cut from a corpus, as more transfer data.

A conversion that learns the original's behaviour layer by layer (the MLA attention transfer) needs inputs, not
labels: every target comes from the original model itself. Its own samples are therefore valid calibration text,
and unlike a fixed corpus there is no end to them. Each sample is ``[bos] + prompt + continuation``:

    prompt_i       = ids[s_i : s_i + P],  s_i = ⌊i · (T − P) / n⌋   (n prompts spread evenly over the T corpus tokens)
    continuation_i ~ p_original(· | [bos] + prompt_i), N new tokens (temperature τ, then the top-k and top-p cuts)

Sampling is seeded per batch (``seed + first sample index``), so a run resumed after batch b writes what an
uninterrupted run writes (on the same machine and thread count: sampling reads floats).
"""

from __future__ import annotations

from typing import Iterator

import torch

from ..config import SampleConfig

__all__ = ["prompt_windows", "sample_batches"]


def prompt_windows(ids: list[int], count: int, length: int) -> torch.LongTensor:
    """``count`` windows of ``length`` tokens spread evenly over ``ids``: LongTensor [count, length].

    Window i starts at ⌊i · (T − length) / count⌋; windows overlap only when the text holds fewer than
    ``count · length`` tokens. ValueError when the text is shorter than one window."""
    if len(ids) < length:
        raise ValueError(f"the prompt text has {len(ids)} tokens, fewer than one prompt of {length}")
    span = len(ids) - length
    starts = [i * span // count for i in range(count)]
    return torch.tensor([ids[s:s + length] for s in starts], dtype=torch.long)


@torch.no_grad()
def sample_batches(model, prompts: torch.LongTensor, config: SampleConfig, bos_id: int | None, pad_id: int,
                   start: int = 0) -> Iterator[tuple[int, torch.LongTensor]]:
    """Yield ``(first index, ids [b, P + N])`` for the batches of ``prompts[start:]`` (``start`` a multiple of the
    batch size, or the end): each row the prompt followed by exactly ``new_tokens`` sampled tokens (the end-of-text token is
    suppressed until then, ``min_new_tokens``). The BOS token, when the model has one, is prepended for
    generation and left out of the rows."""
    if start % config.batch_size and start < prompts.shape[0]:
        raise ValueError(f"start {start} is not a multiple of the batch size {config.batch_size}")
    device = next(model.parameters()).device
    for first in range(start, prompts.shape[0], config.batch_size):
        batch = prompts[first:first + config.batch_size].to(device)                       # [b, P]
        if bos_id is not None:
            batch = torch.cat([torch.full_like(batch[:, :1], bos_id), batch], dim=1)     # [b, 1 + P]
        generator_seed = config.seed + first
        torch.manual_seed(generator_seed)
        out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=True,
                             temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                             max_new_tokens=config.new_tokens, min_new_tokens=config.new_tokens, pad_token_id=pad_id)
        yield first, out[:, 1:] if bos_id is not None else out                           # [b, P + N]
