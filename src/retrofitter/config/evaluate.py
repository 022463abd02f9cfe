"""``EvalConfig``: what ``retrofitter.evaluate`` measures (corpora, window, token cap)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .fields import JsonRoundTrip

__all__ = ["EvalConfig"]


@dataclass(frozen=True)
class EvalConfig(JsonRoundTrip):
    """Settings of ``retrofitter.evaluate``."""

    corpora: tuple[str, ...] = ("wiki-eval",)
    seq_len: int = 512
    max_eval_tokens: int | None = None
    batch_size: int = 4
    context_for_macs: int = 512
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.seq_len < 2:
            raise ValueError(f"the evaluation window (seq_len) must be >= 2 tokens, got {self.seq_len}")
        if self.batch_size < 1:
            raise ValueError(f"the evaluation batch size must be >= 1, got {self.batch_size}")
        if self.max_eval_tokens is not None and self.max_eval_tokens < self.seq_len:
            raise ValueError(f"max_eval_tokens ({self.max_eval_tokens}) is below one evaluation window "
                             f"({self.seq_len} tokens): no perplexity could be measured")



