"""What every config dataclass shares: fields with their flag's help (``option``) and the JSON round trip."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field

__all__ = ["option", "JsonRoundTrip", "COMPRESS_CALIB_SAMPLES", "MLA_CALIB_SAMPLES", "MLA_SEQ_LEN",
           "DEMO_CALIB_SAMPLES", "DEMO_MAX_EVAL_TOKENS", "SHARDING_MODES", "AUTOCAST_CHOICES", "AUTOCAST_DTYPES"]

# Calibration and evaluation defaults shared by the CLI and the job functions (written once)
COMPRESS_CALIB_SAMPLES = 64  # blocks of 512 tokens for compress
MLA_CALIB_SAMPLES = 32       # blocks of MLA_SEQ_LEN tokens for mla
MLA_SEQ_LEN = 512            # mla calibration block length (and perplexity window) unless a preset or flag says
DEMO_CALIB_SAMPLES = 32
DEMO_MAX_EVAL_TOKENS = 4096
AUTOCAST_DTYPES = ("float32", "bfloat16")  # training stages' autocast (pipelines/training.py); float32: none
AUTOCAST_CHOICES = ("auto",) + AUTOCAST_DTYPES  # auto: bfloat16 where it is native, else float32
SHARDING_MODES = ("ddp", "fsdp")  # training stages under several processes (pipelines/sharding.py)


def option(default, help: str, choices=None):
    """A config field with the help text (and choices) of its command-line flag: defined once, here."""
    return field(default=default, metadata={"help": help, "choices": choices})


class JsonRoundTrip:
    def _check_finite(self) -> None:
        """NaN or Inf in a number field is refused by name (it would surface deep in the math otherwise)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{f.name} must be a finite number, got {value}")

    def _check_choice(self, name: str, choices) -> None:
        """Field ``name`` holds one of ``choices`` (refused by name, the choices listed)."""
        value = getattr(self, name)
        if value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}; known: {sorted(names)}")
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        return cls(**values)
