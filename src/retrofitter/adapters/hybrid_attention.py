"""HF wiring of the LoLCATs hybrid attention: a drop-in replacement for Llama-family attention modules.

``HybridSelfAttention`` replaces ``model.layers[i].self_attn`` of Llama / Mistral / Qwen2 / Qwen3
(and SmolLM, which is Llama). It keeps the original projections under their HF names (``q_proj``,
``k_proj``, ``v_proj``, ``o_proj``, Qwen3's ``q_norm``/``k_norm``), so the state dict keys and the
adapters' linear paths are unchanged, and it keeps HF's decoder-layer forward (design.md guideline 4):
the layer calls ``self_attn(hidden_states, position_embeddings, attention_mask, cache, ...)`` as usual.

Per token ``x`` [b, n, d]:

    q = RoPE(norm_q(x W_q)),  k = RoPE(norm_k(x W_k)),  v = x W_v      q [b,h,n,dh], k/v [b,g,n,dh]
    y = HybridLinearAttention(q, k, v)  (window softmax + linear history, design.md §4)
    out = concat_heads(y) W_o                                           [b, n, d]

Modes (attribute ``mode``; not saved): ``"hybrid"`` (default), ``"softmax"`` (the original softmax
attention, computed from the same q, k, v — the teacher of attention transfer), and transfer mode
(``transfer_hook`` set): the module returns the *teacher* output, so later layers see teacher
inputs, and hands ``(y_student, y_teacher)`` ``[b, h, n, dh]`` to the hook (design.md §4, stage 1).

Padding comes from the mask HF passes to attention layers: a 4-D ``[b, 1, q, kv]`` (bool or
additive float) or a 2-D ``[b, kv]`` mask; a key is real iff the query at the same position may see
it (the diagonal), which holds for HF's causal masks with and without a cache.
Only families whose adapter is ``linearizable`` (RoPE attention with q/k/v/o_proj) are supported.

Decode cache: ``HybridCache`` (below) is the model-level HF ``Cache`` of a linearized model; its hybrid
layers are ``adapters.hybrid_cache.HybridCacheLayer`` (the constant-size state), its softmax layers
ordinary ``DynamicLayer``. Sizes: ``state_bytes(batch)`` per layer (constant in the context),
``cache_numbers_per_token() == 0``.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from ..modules.hybrid_attention import HybridLinearAttention
from .hybrid_cache import HybridCacheLayer, attach_hybrid_layer
from .registry import adapter_for

__all__ = [
    "HybridCache",
    "HybridSelfAttention",
    "HybridSettings",
    "swap_to_hybrid",
    "hybrid_attention_modules",
    "key_padding_from_attention_mask",
    "build_from_spec",
]

# Settings a swap needs beyond the original module (same names as HybridLinearAttention's arguments).
HybridSettings = dict


def key_padding_from_attention_mask(attention_mask, query_length: int) -> torch.Tensor | None:
    """``[b, query_length]`` bool (True = real token) from the mask HF gives attention layers, or None.

    HF masks have the new tokens as their last ``query_length`` key columns; a token is real iff
    the query at its position may attend to it (the diagonal of the 4-D causal mask).
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"hybrid attention needs a tensor attention mask (sdpa/eager); got {type(attention_mask).__name__}")
    if attention_mask.dim() == 2:  # [b, kv] padding mask (flash-attention style)
        valid = attention_mask[:, -query_length:]
        return valid.bool() if valid.dtype == torch.bool else valid != 0
    if attention_mask.dim() != 4:
        raise ValueError(f"attention mask must be 2-D or 4-D; got shape {tuple(attention_mask.shape)}")
    kv_length = attention_mask.shape[-1]
    block = attention_mask[:, 0, -query_length:, kv_length - query_length:]  # [b, q, q]
    diagonal = torch.diagonal(block, dim1=-2, dim2=-1)  # [b, q]
    # bool masks: True = attend; additive float masks: 0 = attend, dtype-min = masked.
    return diagonal if diagonal.dtype == torch.bool else diagonal == 0


class HybridSelfAttention(nn.Module):
    """Replacement of one HF attention module; see the module docstring.

    Args:
        original: the HF attention module (its projections and norms are reused, not copied).
        settings: keyword arguments of ``HybridLinearAttention`` (``window``, ``window_kind``,
            ``feature_map``, ``feature_dim``, ``mix_init``, ``linear_weight``, ``execution``).
    """

    def __init__(self, original: nn.Module, settings: HybridSettings):
        super().__init__()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not isinstance(getattr(original, name, None), nn.Module):
                raise TypeError(f"{type(original).__name__} has no {name}; HybridSelfAttention wraps Llama-family attention")
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = original.q_proj, original.k_proj, original.v_proj, original.o_proj
        # Qwen3 normalises each head of q and k before RoPE; other families have no such norm.
        self.q_norm = getattr(original, "q_norm", None)
        self.k_norm = getattr(original, "k_norm", None)
        self.layer_idx = int(original.layer_idx)
        self.head_dim = int(original.head_dim)
        self.scaling = float(getattr(original, "scaling", self.head_dim**-0.5))
        config = getattr(original, "config", None)
        # The teacher must reproduce a sliding-window original (Mistral) exactly.
        self.softmax_sliding_window = getattr(original, "sliding_window", None) or getattr(config, "sliding_window", None)
        self.n_heads = self.q_proj.out_features // self.head_dim
        self.n_kv_heads = self.k_proj.out_features // self.head_dim
        self.settings = dict(settings)
        self.hybrid = HybridLinearAttention(
            self.n_heads, self.n_kv_heads, self.head_dim, softmax_scale=self.scaling, **self.settings
        )
        self.mode = "hybrid"
        self.transfer_hook: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None

    # ---- pieces ---------------------------------------------------------------------------
    def project(self, hidden_states: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[b, h, n, dh]``, k, v ``[b, g, n, dh]`` after the (Qwen3) head norms and RoPE."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape)
        k = self.k_proj(hidden_states).view(shape)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q, k, v

    def softmax_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          key_padding_mask: torch.Tensor | None) -> torch.Tensor:
        """The original causal softmax attention ``[b, h, n, dh]`` (padded queries give zeros)."""
        n = q.shape[2]
        groups = self.n_heads // self.n_kv_heads
        positions = torch.arange(n, device=q.device)
        allowed = positions[None, :] <= positions[:, None]  # [n, n] causal
        if self.softmax_sliding_window:
            allowed = allowed & (positions[None, :] > positions[:, None] - self.softmax_sliding_window)
        allowed = allowed[None, None]
        if key_padding_mask is not None:
            # Every query keeps its own key so that padded rows stay finite (they are zeroed below).
            allowed = (allowed & key_padding_mask[:, None, None, :]) | torch.eye(n, dtype=torch.bool, device=q.device)
        y = F.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), attn_mask=allowed,
            scale=self.scaling,
        )
        if key_padding_mask is not None:
            y = y * key_padding_mask[:, None, :, None].to(y.dtype)
        return y

    def _output(self, y: torch.Tensor) -> torch.Tensor:
        b, _, n, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(b, n, self.n_heads * self.head_dim))

    # ---- HF entry point -------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        """HF attention signature; returns ``(output [b, n, d], None)``."""
        if position_embeddings is None:
            raise ValueError("HybridSelfAttention needs the rotary position_embeddings HF passes to attention layers")
        kwargs.pop("past_key_values", None)
        q, k, v = self.project(hidden_states, position_embeddings)
        key_padding_mask = key_padding_from_attention_mask(attention_mask, q.shape[2])
        if self.transfer_hook is not None or self.mode == "softmax":
            if cache is not None:
                raise ValueError("softmax/transfer mode of HybridSelfAttention runs without a cache")
            with torch.no_grad() if self.transfer_hook is not None else contextlib.nullcontext():
                teacher = self.softmax_attention(q, k, v, key_padding_mask)
            if self.transfer_hook is not None:
                with torch.enable_grad():  # only the feature maps and mixing weights carry gradients
                    student, _ = self.hybrid(q.detach(), k.detach(), v.detach(), key_padding_mask)
                    self.transfer_hook(self.layer_idx, student, teacher.detach())
            return self._output(teacher), None
        if cache is None:
            y, _ = self.hybrid(q, k, v, key_padding_mask)
            return self._output(y), None
        layer_cache = attach_hybrid_layer(cache, self.layer_idx)
        if layer_cache.state is None:
            y, state = self.hybrid(q, k, v, key_padding_mask, return_state=True)
        else:
            y, state = self.hybrid(q, k, v, key_padding_mask, state=layer_cache.state)
        layer_cache.store(state, q.shape[2])
        return self._output(y), None

    # ---- accounting -----------------------------------------------------------------------
    def cache_numbers_per_token(self) -> int:
        """Decode-state growth per token: 0 (the state has a constant size, see ``state_numbers``)."""
        return 0

    def state_numbers(self, batch_size: int = 1) -> int:
        """Numbers in the constant decode state: ring buffer k, v ``2·b·g·s·dh`` + S, z ``b·h·F·(dh + 1)``
        (s = ``hybrid.buffer_size``, from the window kind); bookkeeping tensors aside."""
        ring = self.hybrid.buffer_size
        features = self.hybrid.feature_map_q.output_dim
        per_row = 2 * self.n_kv_heads * ring * self.head_dim + self.n_heads * features * (self.head_dim + 1)
        return batch_size * per_row

    def state_bytes(self, batch_size: int = 1) -> int:
        """Bytes of this layer's decode state for ``batch_size`` sequences, every tensor included, in the
        dtypes it is really kept in: k, v in the projections' dtype, S, z in float32 (or float64) —
        see ``HybridLinearAttention.state_bytes``."""
        return self.hybrid.state_bytes(batch_size, next(self.k_proj.parameters()).dtype)

    def attention_macs_per_token(self, context: int) -> int:
        """q·k and p·v over the window plus phi_q^T S and the state update (context-independent)."""
        ring = self.hybrid.buffer_size
        features = self.hybrid.feature_map_q.output_dim
        window = min(context, ring)
        return 2 * self.n_heads * self.head_dim * window + 2 * self.n_heads * features * (self.head_dim + 1)

    def spec(self) -> dict:
        """Constructor settings for ``retrofitter.json`` (see ``adapters.replacements``)."""
        return {"settings": dict(self.settings)}

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, mode={self.mode!r}"


def swap_to_hybrid(model: nn.Module, settings: HybridSettings, keep_softmax_layers=()) -> list[int]:
    """Replace every decoder layer's attention (except ``keep_softmax_layers``) in place.

    The hybrid modules get the model's parameter dtype/device. Returns the replaced layer indices.
    """
    adapter = adapter_for(model, capability="linearize")
    layers = adapter.decoder_layers(model)
    keep = set(int(i) for i in keep_softmax_layers)
    bad = sorted(i for i in keep if not 0 <= i < len(layers))
    if bad:
        raise ValueError(f"keep_softmax_layers {bad} out of range: the model has {len(layers)} layers (0..{len(layers) - 1})")
    parameter = next(model.parameters())
    replaced = []
    for index, layer in enumerate(layers):
        if index in keep:
            continue
        original = adapter.attention(layer)
        if isinstance(original, HybridSelfAttention):
            raise ValueError(f"layer {index} is already hybrid")
        wrapper = HybridSelfAttention(original, settings)
        wrapper.hybrid.to(device=parameter.device, dtype=parameter.dtype)
        _set_attention(layer, adapter.attention_path, wrapper)
        replaced.append(index)
    return replaced


def _set_attention(layer: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = layer.get_submodule(parent_path) if parent_path else layer
    setattr(parent, attr, module)


def hybrid_attention_modules(model: nn.Module) -> dict[int, HybridSelfAttention]:
    """Layer index -> hybrid attention module, for every swapped layer of ``model``."""
    return {m.layer_idx: m for m in model.modules() if isinstance(m, HybridSelfAttention)}


def build_from_spec(spec: dict, original: nn.Module) -> HybridSelfAttention:
    """Rebuild a saved wrapper around the fresh model's attention module (weights are loaded after)."""
    return HybridSelfAttention(original, spec["settings"])


class HybridCache(Cache):
    """Cache for a linearized model: ``HybridCacheLayer`` for hybrid layers, ``DynamicLayer`` otherwise.

    Pass it to ``generate(..., cache=HybridCache(model))`` or ``model(..., cache=...)``.

    Args:
        model: the (partly) linearized causal LM; the hybrid layers are found from its modules.
    """

    def __init__(self, model: nn.Module):
        num_layers = len(adapter_for(model).decoder_layers(model))
        hybrid = set(hybrid_attention_modules(model))
        layers = [HybridCacheLayer() if index in hybrid else DynamicLayer() for index in range(num_layers)]
        super().__init__(layers=layers)

    def state_nbytes(self) -> int:
        """Bytes of all hybrid states (constant in the number of tokens seen)."""
        return sum(layer.nbytes() for layer in self.layers if isinstance(layer, HybridCacheLayer))
