"""HF wiring of ``LatentAttention`` (modules/latent_attention.py): conversion of a compressed model and
the rebuild used by the checkpoint loader.

Everything family-specific comes from the model's adapter (adapters/base.py): whether the family is
``latent_attention`` capable, its rotary-embedding class (``rotary_embedding_class(model)``: RoPE
execution, or None: absorbed execution; Gemma 3: one table per layer type), where the projections
are inside the attention module (``attention_relative_path``), the layer's sliding window, and the
keyword carrying the cache. From the HF attention module itself: ``scaling`` (Gemma:
query_pre_attn_scalar^-1/2), ``attn_logit_softcapping`` (Gemma 2) and the q/k norms. The cache slots
are ``adapters.latent_cache`` layers (sliding layers keep only their window).

Conversion keeps the projection modules as they are (``LatentLinear`` after compression, or dense
``nn.Linear``) and only swaps the attention module, so the dense-product model (HF attention over
LatentLinear projections) and the latent-cache model compute the same function; the latter caches
r_k + r_v numbers per token and layer instead of 2·n_kv·d_h.
"""

from __future__ import annotations

import sys
from typing import Callable

from torch import nn

from ..modules.latent_attention import LatentAttention
from ..modules.latent_linear import LatentLinear
from .latent_cache import latent_cache_layer
from .registry import adapter_for

__all__ = ["latent_attention_from", "to_latent_attention", "latent_attention_spec", "rebuild_latent_attention",
           "latent_cache_numbers_per_token", "LayerTypeRotary", "attention_resolver", "eager_kernel"]

CAPABILITY = "latent_attention"
ROLES = ("q", "k", "v", "o")


class LayerTypeRotary(nn.Module):
    """A rotary embedding with one table per layer type (Gemma 3), bound to one layer's type:
    forward(x, position_ids) -> (cos, sin) [b, n, dh_rot] = rotary(x, position_ids, layer_type)."""

    def __init__(self, rotary: nn.Module, layer_type: str):
        super().__init__()
        self.rotary = rotary
        self.layer_type = layer_type

    def forward(self, x, position_ids):
        return self.rotary(x, position_ids, self.layer_type)


def attention_resolver(config, eager: Callable) -> Callable[[], Callable]:
    """Resolve HF's attention kernel at call time (the implementation can be switched after conversion)."""

    def resolve():
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager)

    return resolve


def eager_kernel(attention: nn.Module, softcap: float | None) -> Callable:
    """The eager kernel: Llama's, or with soft-capping the family's own (Llama's has no ``softcap``)."""
    if softcap:
        eager = getattr(sys.modules.get(type(attention).__module__), "eager_attention_forward", None)
        if eager is None:
            raise ValueError(f"{type(attention).__name__} soft-caps its scores but its module has no eager kernel")
        return eager
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return eager_attention_forward


def latent_attention_from(attention: nn.Module, model: nn.Module) -> LatentAttention:
    """Wrap ``attention`` (an HF attention module of ``model``; projections possibly LatentLinear)."""
    adapter = adapter_for(model, capability=CAPABILITY)
    layout = adapter.attention_layout(model)
    config = attention.config
    paths = {role: adapter.attention_relative_path(role) for role in ROLES}
    children = {path.split(".")[0]: attention.get_submodule(path.split(".")[0]) for path in paths.values()}
    rotary_class = adapter.rotary_embedding_class(model)
    rotary = rotary_class(config=config) if rotary_class is not None else None
    if rotary is not None:
        query = attention.get_submodule(paths["q"])
        reference = query.up if isinstance(query, LatentLinear) else query.weight
        rotary = rotary.to(reference.device)
        if adapter.rotary_takes_layer_type:
            rotary = LayerTypeRotary(rotary, attention.layer_type)
    softcap = getattr(attention, "attn_logit_softcapping", None)
    module = LatentAttention(
        children, paths, n_heads=layout.n_heads, n_kv_heads=layout.n_kv_heads, head_dim=layout.head_dim,
        layer_idx=attention.layer_idx, scaling=attention.scaling,
        attention_resolver=attention_resolver(config, eager_kernel(attention, softcap)), rotary=rotary,
        q_norm=getattr(attention, "q_norm", None), k_norm=getattr(attention, "k_norm", None),
        cache_layer=latent_cache_layer, softcap=softcap, sliding_window=adapter.sliding_window(attention),
        cache_kwarg=adapter.cache_kwarg)
    module.source_class = type(attention).__name__
    return module


def to_latent_attention(model: nn.Module) -> nn.Module:
    """Replace every decoder layer's attention by a LatentAttention (in place); returns ``model``."""
    adapter = adapter_for(model, capability=CAPABILITY)
    for layer in adapter.decoder_layers(model):
        attention = adapter.attention(layer)
        if isinstance(attention, LatentAttention):
            continue
        adapter.set_attention(layer, latent_attention_from(attention, model))
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
    """What the loader needs besides the HF config: which projections are LatentLinear, of what shape
    (keyed by their paths inside the attention module)."""
    return {"projections": {module.paths[role]: _projection_spec(module.projection(role)) for role in ROLES}}


def rebuild_latent_attention(spec: dict, original: nn.Module, model: nn.Module) -> LatentAttention:
    """Empty LatentAttention of the recorded shapes around ``original`` (the fresh HF attention of ``model``)."""
    adapter_for(model).decoder_layers(model)  # split fused projections first (their parts are named in spec)
    for path, entry in spec["projections"].items():
        if entry["type"] == "LatentLinear":
            fields = {k: v for k, v in entry.items() if k != "type"}
            reference = original.get_submodule(path).weight
            original.set_submodule(path, LatentLinear(**fields, dtype=reference.dtype, device=reference.device))
    return latent_attention_from(original, model)
