"""HF wiring of ``LatentAttention`` (modules/latent_attention.py): conversion of a compressed model and
the rebuild used by the checkpoint loader.

Everything family-specific comes from the model's adapter (adapters/base.py): whether the family is
``latent_attention`` capable, its rotary-embedding class (``rotary_embedding_class(model)``: RoPE
execution, or None: absorbed execution) and the output projection's name
(``attention_output_name``). The cache slots are ``adapters.latent_cache.LatentCacheLayer``.

Conversion keeps the projection modules as they are (``LatentLinear`` after compression, or dense
``nn.Linear``) and only swaps the attention module, so the dense-product model (HF attention over
LatentLinear projections) and the latent-cache model compute the same function; the latter caches
r_k + r_v numbers per token and layer instead of 2·n_kv·d_h.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from ..modules.latent_attention import LatentAttention
from ..modules.latent_linear import LatentLinear
from .latent_cache import latent_cache_layer
from .registry import adapter_for

__all__ = ["latent_attention_from", "to_latent_attention", "latent_attention_spec", "rebuild_latent_attention",
           "latent_cache_numbers_per_token"]

CAPABILITY = "latent_attention"


def _attention_resolver(config) -> Callable[[], Callable]:
    """Resolve HF's attention kernel at call time (the implementation can be switched after conversion)."""

    def resolve():
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.llama.modeling_llama import eager_attention_forward

        return ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)

    return resolve


def latent_attention_from(attention: nn.Module, model: nn.Module) -> LatentAttention:
    """Wrap ``attention`` (an HF attention module of ``model``; projections possibly LatentLinear)."""
    adapter = adapter_for(model, capability=CAPABILITY)
    output_name = adapter.attention_output_name
    config = attention.config
    n_heads = config.num_attention_heads
    n_kv_heads = getattr(config, "num_key_value_heads", None) or n_heads
    rotary_class = adapter.rotary_embedding_class(model)
    rotary = rotary_class(config=config) if rotary_class is not None else None
    if rotary is not None:
        reference = attention.q_proj.up if isinstance(attention.q_proj, LatentLinear) else attention.q_proj.weight
        rotary = rotary.to(reference.device)
    module = LatentAttention(
        attention.q_proj, attention.k_proj, attention.v_proj, getattr(attention, output_name),
        n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=attention.head_dim, layer_idx=attention.layer_idx,
        scaling=attention.scaling, attention_resolver=_attention_resolver(config), rotary=rotary,
        q_norm=getattr(attention, "q_norm", None), k_norm=getattr(attention, "k_norm", None),
        output_name=output_name, cache_layer=latent_cache_layer)
    module.source_class = type(attention).__name__
    return module


def to_latent_attention(model: nn.Module) -> nn.Module:
    """Replace every decoder layer's attention by a LatentAttention (in place); returns ``model``."""
    adapter = adapter_for(model, capability=CAPABILITY)
    for layer in adapter.decoder_layers(model):
        attention = adapter.attention(layer)
        if isinstance(attention, LatentAttention):
            continue
        _set_child(layer, adapter.attention_path, latent_attention_from(attention, model))
    return model


def latent_cache_numbers_per_token(model: nn.Module) -> int:
    """Σ over layers of r_k + r_v (numbers the latent cache grows by per token)."""
    adapter = adapter_for(model)
    return sum(adapter.attention(layer).cache_numbers_per_token() for layer in adapter.decoder_layers(model))


def _projection_spec(module: nn.Module) -> dict:
    if isinstance(module, LatentLinear):
        return {"type": "LatentLinear", "in_features": module.in_features, "out_features": module.out_features,
                "rank": module.rank, "junction": module.junction, "bias": module.bias is not None}
    return {"type": "Linear"}


def latent_attention_spec(module: LatentAttention) -> dict:
    """What the loader needs besides the HF config: which projections are LatentLinear, of what shape."""
    names = ("q_proj", "k_proj", "v_proj", module.output_name)
    return {"projections": {name: _projection_spec(getattr(module, name)) for name in names}}


def rebuild_latent_attention(spec: dict, original: nn.Module, model: nn.Module) -> LatentAttention:
    """Empty LatentAttention of the recorded shapes around ``original`` (the fresh HF attention of ``model``)."""
    for name, entry in spec["projections"].items():
        if entry["type"] == "LatentLinear":
            fields = {k: v for k, v in entry.items() if k != "type"}
            reference = getattr(original, name).weight
            setattr(original, name, LatentLinear(**fields, dtype=reference.dtype, device=reference.device))
    return latent_attention_from(original, model)


def _set_child(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, attr, module)
