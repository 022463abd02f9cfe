"""Registry of replacement modules that can be saved and rebuilt (used by ``retrofitter.checkpoint``).

A retrofitted model has some modules replaced (``LatentLinear`` projections, ``LatentAttention`` or
``HybridSelfAttention`` or ``MLAAttention`` attention, ``FusedProjection`` splits of fused projections). For each such class, ``ReplacementType`` says how to describe an
instance (``spec(module) -> dict``, written to ``retrofitter.json``) and how to rebuild an empty one of
the same shapes (``build(spec, original, model)``: ``original`` is the module at the same path in the
fresh model built from ``config.json``, ``model`` that fresh model); the weights are loaded afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from ..modules.fused_projection import FusedProjection
from ..modules.latent_attention import LatentAttention
from ..modules.latent_linear import LatentLinear
from ..modules.mla_attention import MLAAttention
from .hybrid_attention import HybridSelfAttention, build_from_spec
from .latent_attention import latent_attention_spec, rebuild_latent_attention
from .mla_attention import mla_attention_spec, rebuild_mla_attention

__all__ = ["ReplacementType", "replacement_types"]


@dataclass(frozen=True)
class ReplacementType:
    """How to describe (``spec``) and rebuild (``build(spec, original, model)``) a replacement module."""

    cls: type
    spec: Callable[[nn.Module], dict]
    build: Callable[[dict, nn.Module, nn.Module], nn.Module]


def _latent_linear_spec(module: LatentLinear) -> dict:
    return {"in_features": module.in_features, "out_features": module.out_features, "rank": module.rank,
            "junction": module.junction, "bias": module.bias is not None}


def _latent_linear_build(spec: dict, original: nn.Module, model: nn.Module) -> LatentLinear:
    return LatentLinear(**spec)


def _fused_projection_spec(module: FusedProjection) -> dict:
    return module.spec()


def _fused_projection_build(spec: dict, original: nn.Module, model: nn.Module) -> FusedProjection:
    """The split of the fresh fused ``nn.Linear`` (or the split already made by an enclosing rebuild)."""
    widths = {str(name): int(width) for name, width in spec["parts"]}
    if isinstance(original, FusedProjection):
        if list(original.widths().items()) != list(widths.items()) or original.groups != int(spec["groups"]):
            raise ValueError(f"fused projection split {original.widths()} (groups {original.groups}) differs from "
                             f"the recorded {widths} (groups {spec['groups']})")
        return original
    if not isinstance(original, nn.Linear):
        raise TypeError(f"a FusedProjection replaces an nn.Linear, found {type(original).__name__}")
    return FusedProjection.split(original, widths, int(spec["groups"]))


def _hybrid_attention_spec(module: HybridSelfAttention) -> dict:
    return module.spec()


def _hybrid_attention_build(spec: dict, original: nn.Module, model: nn.Module) -> HybridSelfAttention:
    return build_from_spec(spec, original, model)


def replacement_types() -> dict[str, ReplacementType]:
    """Class name -> ``ReplacementType`` of every saveable replacement (an explicit, fresh dict)."""
    return {
        "FusedProjection": ReplacementType(FusedProjection, _fused_projection_spec, _fused_projection_build),
        "HybridSelfAttention": ReplacementType(HybridSelfAttention, _hybrid_attention_spec, _hybrid_attention_build),
        "LatentAttention": ReplacementType(LatentAttention, latent_attention_spec, rebuild_latent_attention),
        "LatentLinear": ReplacementType(LatentLinear, _latent_linear_spec, _latent_linear_build),
        "MLAAttention": ReplacementType(MLAAttention, mla_attention_spec, rebuild_mla_attention),
    }
