"""HF wiring of ``MLAAttention`` (modules/mla_attention.py): what a family must be for the conversion, the
module built from fitted factors (linalg/mla.py), and its rebuild by the checkpoint loader.

Supported: families with the ``latent_attention`` capability whose attention uses full rotate-half RoPE and
neither per-head q/k norms nor score soft-capping (Llama, Mistral, Qwen2, Gemma): those features are not in
the MLA format and have no exact fold. Everything else is refused in one line before any work, naming why.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..modules.mla_attention import MLAAttention
from .latent_attention import attention_resolver, eager_kernel
from .latent_cache import latent_cache_layer
from .registry import UnsupportedArchitectureError, adapter_for

__all__ = ["check_mla_supported", "model_inv_freq", "attention_kwargs_at", "attention_probabilities",
           "attention_score_settings", "fold_mla_up_projections", "empty_mla_attention", "mla_attention_from_factors",
           "mla_attention_spec", "narrow_value_resolver", "rebuild_mla_attention", "split_decode_resolver",
           "NARROW_VALUE_IMPLEMENTATIONS"]

CAPABILITY = "latent_attention"
# HF attention implementations whose kernel takes a value narrower than the key (MLAAttention's narrow_value):
# eager multiplies p·v as given, flex_attention's fused kernel takes its own value width.
NARROW_VALUE_IMPLEMENTATIONS = ("eager", "flex_attention")


def check_mla_supported(model: nn.Module) -> None:
    """Raise ``UnsupportedArchitectureError`` naming the reason unless ``model`` can be converted to MLA."""
    adapter = adapter_for(model, capability=CAPABILITY)
    name = type(model).__name__
    if not adapter.uses_rope:
        raise UnsupportedArchitectureError(f"MLA needs rotary position embeddings; {name} has none "
                                           f"(use --method latentllm --kv-ratio, whose absorbed cache covers it)")
    config = adapter.text_config(model)
    layout = adapter.attention_layout(model)
    factor = getattr(config, "partial_rotary_factor", None)
    if factor is None:
        factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    if factor != 1.0 or adapter.fused:
        raise UnsupportedArchitectureError(f"MLA: {name} rotates only part of each head (partial "
                                           f"rotary) or fuses its projections, which the MLA layout cannot express")
    attention = adapter.attention(adapter.decoder_layers(model)[0])
    if getattr(attention, "q_norm", None) is not None or getattr(attention, "k_norm", None) is not None:
        raise UnsupportedArchitectureError(f"MLA: {name} normalises each head's queries and keys "
                                           f"(q/k norms), which do not commute with the latent")
    if getattr(attention, "attn_logit_softcapping", None) or adapter.rotary_takes_layer_type:
        raise UnsupportedArchitectureError(f"MLA: {name} soft-caps its scores or uses per-layer-type "
                                           f"rotary tables; not supported")
    if layout.head_dim % 2:
        raise UnsupportedArchitectureError(f"MLA: head_dim {layout.head_dim} is odd")


def model_inv_freq(model: nn.Module) -> torch.Tensor:
    """θ_f [dh/2] of the model's rotary embedding (its scaling included)."""
    adapter = adapter_for(model)
    return model.get_submodule(adapter.rotary_path).inv_freq.detach().to(torch.float64)


def attention_kwargs_at(model: nn.Module, kwargs: dict, position_ids: torch.Tensor) -> dict:
    """An attention call's keyword arguments (as the decoder layer passes them) moved to ``position_ids`` [b, n]:
    the model's own rotary tables for those positions (its scaling included), and the ids where the call has them."""
    rotary = model.get_submodule(adapter_for(model, capability=CAPABILITY).rotary_path)
    hidden = kwargs["hidden_states"]
    ids = position_ids.to(hidden.device)
    moved = dict(kwargs, position_embeddings=rotary(hidden, ids))  # (cos, sin), each [b, n, dh]
    if moved.get("position_ids") is not None:
        moved["position_ids"] = ids
    return moved


@torch.no_grad()
def attention_probabilities(model: nn.Module, attention: nn.Module, kwargs: dict) -> torch.Tensor:
    """The softmax weights p [b, h, n, N] of HF ``attention`` called with ``kwargs`` (as the decoder layer passes
    them): run through the family's eager kernel, the one that returns them, with the layer's causal (and
    sliding-window) mask written out when the call carries none (sdpa's is_causal path), so every masked entry is
    exactly 0. The model's attention setting is put back afterwards."""
    kwargs = dict(kwargs)
    if kwargs.get("attention_mask") is None:
        hidden = kwargs["hidden_states"]
        n = hidden.shape[1]
        allowed = torch.ones(n, n, dtype=torch.bool, device=hidden.device).tril()
        window = adapter_for(model).sliding_window(attention)
        if window:  # HF's sliding mask: key j is seen from query i when i - window < j <= i
            allowed &= ~torch.ones_like(allowed).tril(-window)
        lowest = torch.finfo(hidden.dtype).min
        kwargs["attention_mask"] = torch.zeros(n, n, dtype=hidden.dtype, device=hidden.device).masked_fill(
            ~allowed, lowest)[None, None]                                        # additive [1, 1, n, n]
    config = attention.config
    setting, config._attn_implementation = config._attn_implementation, "eager"
    try:
        weights = attention(**kwargs)[1]
    finally:
        config._attn_implementation = setting
    if weights is None:
        raise ValueError(f"{type(attention).__name__} returned no attention weights from its eager kernel")
    return weights


def attention_score_settings(model: nn.Module, attention: nn.Module) -> tuple[float, int | None]:
    """(score scaling, sliding window or None) of HF ``attention``: what its softmax sees besides q and k."""
    return float(attention.scaling), adapter_for(model).sliding_window(attention)


def narrow_value_resolver(config) -> Callable[[], bool]:
    """() -> whether ``config``'s attention implementation now is one of ``NARROW_VALUE_IMPLEMENTATIONS`` (read
    at call time, as the kernel: the implementation can be switched after conversion). Any other, one registered
    by a user included, reads the key as the value: correct with every kernel, only wider."""
    return lambda: config._attn_implementation in NARROW_VALUE_IMPLEMENTATIONS


def split_decode_resolver(config) -> Callable[[], bool]:
    """() -> whether ``config``'s attention implementation now is HF's ``sdpa``, whose function the split-key CPU
    decode kernel (ops/decode_attention.py) computes."""
    return lambda: config._attn_implementation == "sdpa"


def empty_mla_attention(attention: nn.Module, model: nn.Module, spec: dict) -> MLAAttention:
    """An MLAAttention of ``spec``'s shapes (weights uninitialised) in place of HF ``attention``."""
    adapter = adapter_for(model, capability=CAPABILITY)
    layout = adapter.attention_layout(model)
    o_proj = attention.get_submodule(adapter.attention_output_name)
    reference = o_proj.weight
    module = MLAAttention(
        hidden_size=o_proj.out_features, n_heads=layout.n_heads, n_kv_heads=layout.n_kv_heads,
        head_dim=layout.head_dim, kv_rank=spec["kv_rank"], rope_dim=spec["rope_dim"], qk_nope_dim=spec["qk_nope_dim"],
        freq_index=torch.tensor(spec["freq_index"], dtype=torch.long), o_proj=o_proj, layer_idx=attention.layer_idx,
        scaling=attention.scaling, attention_resolver=attention_resolver(attention.config, eager_kernel(attention, None)),
        cache_layer=latent_cache_layer, q_bias=spec["q_bias"], kv_bias=spec["kv_bias"], k_pe_bias=spec["k_pe_bias"],
        sliding_window=adapter.sliding_window(attention), cache_kwarg=adapter.cache_kwarg,
        k_up_folded=spec.get("k_up_folded", False), v_up_folded=spec.get("v_up_folded", False),  # absent: before folds
        narrow_value=narrow_value_resolver(attention.config), split_decode=split_decode_resolver(attention.config),
        dtype=reference.dtype, device=reference.device)
    module.source_class = type(attention).__name__
    return module


def mla_attention_from_factors(attention: nn.Module, model: nn.Module, factors) -> MLAAttention:
    """The MLAAttention of ``factors`` (``linalg.mla.MLAFactors``) replacing HF ``attention``, in its dtype."""
    spec = {"kv_rank": factors.kv_a_weight.shape[0], "rope_dim": factors.k_pe_weight.shape[0],
            "qk_nope_dim": factors.k_up.shape[0], "freq_index": factors.freq_index.tolist(),
            "q_bias": factors.q_bias is not None, "kv_bias": factors.kv_a_bias is not None,
            "k_pe_bias": factors.k_pe_bias is not None}
    module = empty_mla_attention(attention, model, spec)
    with torch.no_grad():
        for linear, weight, bias in ((module.q_proj, factors.q_weight, factors.q_bias),
                                     (module.kv_a_proj, factors.kv_a_weight, factors.kv_a_bias),
                                     (module.k_pe_proj, factors.k_pe_weight, factors.k_pe_bias)):
            linear.weight.copy_(weight)
            if bias is not None:
                linear.bias.copy_(bias)
        module.k_up.copy_(factors.k_up)
        module.v_up.copy_(factors.v_up)
    return module


def fold_mla_up_projections(model: nn.Module) -> int:
    """Fold every MLAAttention's square up-projections into its q / o projections (``fold_up_projections``);
    returns how many K_up and V_up were folded by this call."""
    folded = 0
    for module in model.modules():
        if isinstance(module, MLAAttention):
            before = (module.k_up is None) + (module.v_up is None)
            after = module.fold_up_projections()
            folded += after["k_up"] + after["v_up"] - before
    return folded


def mla_attention_spec(module: MLAAttention) -> dict:
    return module.spec()


def rebuild_mla_attention(spec: dict, original: nn.Module, model: nn.Module) -> MLAAttention:
    """Empty MLAAttention of the recorded shapes around ``original`` (the fresh HF attention of ``model``)."""
    return empty_mla_attention(original, model, spec)
