"""Frozen configuration dataclasses with a JSON round trip (``to_dict`` / ``from_dict``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

__all__ = ["CompressConfig", "LinearizeConfig", "EvalConfig", "COMPRESS_METHODS"]

# compress --method -> preconditioner of the local activation-aware SVD (design.md §3, paper Table 1)
COMPRESS_METHODS: dict[str, str] = {
    "svd": "plain",
    "asvd-hessian": "hessian",
    "asvd-l2": "l2",
    "asvd-cov": "cov",
    "asvd-rootcov": "rootcov",
    "svd-llm": "cholesky",
    "latentllm": "rootcov",
}


class _JsonRoundTrip:
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


@dataclass(frozen=True)
class CompressConfig(_JsonRoundTrip):
    """Settings of ``retrofitter.compress``.

    ratio: fraction of the compressible linear parameters removed (0 < ratio < 1).
    method: one of ``COMPRESS_METHODS``; the asvd-* variants differ by preconditioner.
    junction: store factors in block-identity form, r(d+d') − r² parameters instead of r(d+d').
    statistics: ``"compressed"`` — layer l is calibrated on the outputs of the already compressed
      layers < l (sequential); ``"teacher"`` — on the original model's activations.
    damping: λ in C + λ·mean(diag C)·I.
    targets: projection names to compress (adapter names, e.g. ``q k v o gate up down``); empty = all.
    allocation: ``"uniform"`` (each matrix keeps 1 − ratio of its parameters) or ``"global"``.
    """

    ratio: float = 0.2
    method: str = "asvd-rootcov"
    junction: bool = True
    statistics: str = "compressed"
    damping: float = 1e-2
    targets: tuple[str, ...] = ()
    allocation: str = "uniform"
    batch_size: int = 8
    joint_qk: bool = True
    joint_vo: bool = False
    joint_mlp: bool = True
    qk_iterations: int = 8

    def __post_init__(self):
        if not 0.0 < self.ratio < 1.0:
            raise ValueError(f"ratio must lie in (0, 1) (fraction of linear parameters removed), got {self.ratio}")
        if self.method not in COMPRESS_METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose from {', '.join(COMPRESS_METHODS)}")
        if self.statistics not in ("compressed", "teacher"):
            raise ValueError(f"statistics must be 'compressed' or 'teacher', got {self.statistics!r}")
        if self.allocation not in ("uniform", "global"):
            raise ValueError(f"allocation must be 'uniform' or 'global', got {self.allocation!r}")
        if self.damping < 0:
            raise ValueError(f"damping must be >= 0, got {self.damping}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    @property
    def preconditioner(self) -> str:
        return COMPRESS_METHODS[self.method]


@dataclass(frozen=True)
class LinearizeConfig(_JsonRoundTrip):
    """Settings of ``retrofitter.linearize`` (LoLCATs, design.md §4)."""

    feature_map: str = "hedgehog"
    feature_dim: int = 64
    window: int = 64
    window_kind: str = "sliding"
    transfer_tokens: int = 200_000
    lora_tokens: int = 100_000
    seq_len: int = 512
    batch_size: int = 1
    transfer_lr: float = 1e-2
    lora_lr: float = 1e-4
    lora_rank: int = 8
    lora_alpha: int = 16
    keep_softmax_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class EvalConfig(_JsonRoundTrip):
    """Settings of ``retrofitter.evaluate``."""

    corpora: tuple[str, ...] = ("wiki-eval",)
    seq_len: int = 512
    max_eval_tokens: int | None = None
    batch_size: int = 4
    context_for_macs: int = 512
    extra: dict = field(default_factory=dict)
