"""Registry of replacement modules that can be saved and rebuilt (see ``retrofitter.checkpoint``)."""

from __future__ import annotations

from torch import nn

__all__ = ["REPLACEMENT_TYPES"]


def _latent_linear_spec(module) -> dict:
    return {"in_features": module.in_features, "out_features": module.out_features, "rank": module.rank,
            "junction": module.junction, "bias": module.bias is not None}


def _latent_linear_build(spec: dict, _original: nn.Module):
    from .latent_linear import LatentLinear

    return LatentLinear(**spec)


def REPLACEMENT_TYPES() -> dict:
    """Class name -> ``ReplacementType`` (imports lazily so that importing the registry is cheap)."""
    from ..checkpoint import ReplacementType
    from .latent_linear import LatentLinear

    return {
        "LatentLinear": ReplacementType(LatentLinear, _latent_linear_spec, _latent_linear_build),
    }
