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


def _latent_attention_spec(module) -> dict:
    # HF wiring (rotary class, output name) lives in adapters/; imported lazily, only when saving/loading.
    from ..adapters.latent_attention import latent_attention_spec

    return latent_attention_spec(module)


def _latent_attention_build(spec: dict, original: nn.Module):
    from ..adapters.latent_attention import rebuild_latent_attention

    return rebuild_latent_attention(spec, original)


def _hybrid_attention_spec(module) -> dict:
    return module.spec()


def _hybrid_attention_build(spec: dict, original: nn.Module):
    from ..adapters.hybrid_attention import build_from_spec

    return build_from_spec(spec, original)


def REPLACEMENT_TYPES() -> dict:
    """Class name -> ``ReplacementType`` (imports lazily so that importing the registry is cheap)."""
    from ..checkpoint import ReplacementType
    from ..adapters.hybrid_attention import HybridSelfAttention
    from .latent_attention import LatentAttention
    from .latent_linear import LatentLinear

    return {
        "HybridSelfAttention": ReplacementType(HybridSelfAttention, _hybrid_attention_spec, _hybrid_attention_build),
        "LatentAttention": ReplacementType(LatentAttention, _latent_attention_spec, _latent_attention_build),
        "LatentLinear": ReplacementType(LatentLinear, _latent_linear_spec, _latent_linear_build),
    }
