"""``SampleConfig``: how ``retrofitter sample`` writes text with the original model (pipelines/sample_text.py)."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import JsonRoundTrip, option

__all__ = ["SampleConfig"]


@dataclass(frozen=True)
class SampleConfig(JsonRoundTrip):
    """``samples`` texts, each ``prompt_tokens`` tokens of the prompt corpus followed by ``new_tokens`` tokens the
    model samples (temperature, then the top-k and top-p cuts), ``batch_size`` sequences per ``generate`` call,
    seeded by ``seed`` + the index of a batch's first sample."""

    samples: int = option(896, "texts to write (each one block of prompt + new tokens; 896 = the blocks of "
                               "mla --preset quality)")
    prompt_tokens: int = option(32, "tokens of the prompt corpus that start each text")
    new_tokens: int = option(480, "tokens the model writes after each prompt (the end-of-text token is held back "
                                  "until then)")
    batch_size: int = option(64, "texts per generate call")
    temperature: float = option(1.0, "sampling temperature")
    top_k: int = option(50, "keep the k most likely tokens before sampling (0: no cut)")
    top_p: float = option(0.95, "keep the most likely tokens up to this probability mass (1: no cut)")
    seed: int = option(0, "seed of the first batch (batch b: seed + its first sample's index)")

    def __post_init__(self):
        self._check_finite()
        for name in ("samples", "prompt_tokens", "new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no cut), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
