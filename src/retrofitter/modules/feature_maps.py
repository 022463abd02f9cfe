"""Per-head feature maps phi: R^dh -> R^F for linear attention (LoLCATs / Hedgehog / T2R / elu+1).

All maps take ``x [b, h, n, dh]`` (queries or keys after RoPE) and return ``[b, h, n, F]`` with
nonnegative entries, so ``phi(q).phi(k) >= 0`` and the hybrid layer's denominator stays positive.
Learned maps have one projection per head: ``W [h, dh, feature_dim]``, ``b [h, feature_dim]``,
initialised identity-like (``W_h = eye(dh, feature_dim)``: truncated or zero-padded), ``b = 0``.

* ``hedgehog``: ``phi(x) = [softmax(xW + b), softmax(-(xW + b))]`` (softmax over features),
  ``F = 2 * feature_dim``; each half sums to 1.
* ``t2r``: ``phi(x) = relu(xW + b)``, ``F = feature_dim``.
* ``elu``: ``phi(x) = elu(x) + 1``, no parameters, ``F = dh``.

Build by name with ``build_feature_map(name, n_heads, head_dim, feature_dim)``; ``FEATURE_MAPS``
is the registry (add a class there to add a map). A layer holds separate maps for q and k.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "FeatureMap",
    "HedgehogFeatureMap",
    "T2RFeatureMap",
    "EluFeatureMap",
    "FEATURE_MAPS",
    "build_feature_map",
]


class FeatureMap(nn.Module):
    """Base class: ``forward(x [b, h, n, dh]) -> [b, h, n, output_dim]``."""

    def __init__(self, n_heads: int, head_dim: int, feature_dim: int):
        super().__init__()
        if min(n_heads, head_dim, feature_dim) < 1:
            raise ValueError(f"n_heads, head_dim, feature_dim must be >= 1; got {n_heads}, {head_dim}, {feature_dim}")
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.feature_dim = feature_dim

    @property
    def output_dim(self) -> int:
        raise NotImplementedError

    def _check(self, x: torch.Tensor) -> None:
        if x.dim() != 4 or x.shape[1] != self.n_heads or x.shape[3] != self.head_dim:
            expected = f"[b, h={self.n_heads}, n, dh={self.head_dim}]"
            raise ValueError(f"{type(self).__name__} expects {expected}; got {tuple(x.shape)}")

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, head_dim={self.head_dim}, output_dim={self.output_dim}"


class _ProjectedFeatureMap(FeatureMap):
    """Shared per-head affine projection ``u = x W_h + b_h`` with identity-like initialisation."""

    def __init__(self, n_heads: int, head_dim: int, feature_dim: int):
        super().__init__(n_heads, head_dim, feature_dim)
        # Identity-like start: phi(q).phi(k) then follows q.k closely, so attention transfer
        # starts from a map that already ranks keys like softmax attention does.
        eye = torch.eye(head_dim, feature_dim)
        self.weight = nn.Parameter(eye.expand(n_heads, head_dim, feature_dim).clone())  # [h, dh, f]
        self.bias = nn.Parameter(torch.zeros(n_heads, feature_dim))  # [h, f]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        # Parameters follow the input dtype: the ops compute in float32/float64 even for bf16 models.
        weight, bias = self.weight.to(x.dtype), self.bias.to(x.dtype)
        return torch.einsum("bhnd,hdf->bhnf", x, weight) + bias[:, None, :]


class HedgehogFeatureMap(_ProjectedFeatureMap):
    """``phi(x) = [softmax(xW + b), softmax(-(xW + b))]``, F = 2 * feature_dim."""

    @property
    def output_dim(self) -> int:
        return 2 * self.feature_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.project(x)
        return torch.cat([torch.softmax(u, dim=-1), torch.softmax(-u, dim=-1)], dim=-1)


class T2RFeatureMap(_ProjectedFeatureMap):
    """``phi(x) = relu(xW + b)``, F = feature_dim."""

    @property
    def output_dim(self) -> int:
        return self.feature_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.project(x))


class EluFeatureMap(FeatureMap):
    """``phi(x) = elu(x) + 1``, F = head_dim; no parameters (``feature_dim`` is ignored)."""

    @property
    def output_dim(self) -> int:
        return self.head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        return torch.nn.functional.elu(x) + 1.0


FEATURE_MAPS: dict[str, type[FeatureMap]] = {
    "hedgehog": HedgehogFeatureMap,
    "t2r": T2RFeatureMap,
    "elu": EluFeatureMap,
}


def build_feature_map(name: str, n_heads: int, head_dim: int, feature_dim: int = 64) -> FeatureMap:
    """Feature map ``name`` from ``FEATURE_MAPS`` for ``n_heads`` heads of size ``head_dim``."""
    if name not in FEATURE_MAPS:
        raise ValueError(f"unknown feature map {name!r}; choose one of {sorted(FEATURE_MAPS)}")
    return FEATURE_MAPS[name](n_heads, head_dim, feature_dim)
