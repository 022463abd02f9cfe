"""HF wiring of the LoLCATs hybrid attention: a drop-in replacement for RoPE attention modules.

``HybridSelfAttention`` replaces the attention module of every ``linearizable`` family (Llama,
Mistral, Qwen2/3, Gemma 2/3, Phi-3, GPT-NeoX). It keeps the original projections under their HF
names and paths (``q_proj`` ... ``o_proj``, Qwen3's / Gemma 3's ``q_norm``/``k_norm``; GPT-NeoX's split
``query_key_value.{q,k,v}`` and ``dense``), so the state dict keys and the adapters' linear paths are
unchanged, and it keeps HF's decoder-layer forward (design.md guideline 4): the layer calls
``self_attn(hidden_states, position_embeddings, attention_mask, cache, ...)`` as usual (GPT-NeoX
passes the cache as ``layer_past``: the adapter's ``cache_kwarg``).

The teacher (``"softmax"`` mode) reproduces the original attention exactly: the family's ``scaling``
(Gemma: query_pre_attn_scalar^-1/2), the layer's own sliding window (Gemma 2/3 sliding layers,
Mistral / Phi-3 with a window; global layers have none), score soft-capping (Gemma 2), q/k norms and
partial rotary embeddings (GPT-NeoX). A sliding layer is linearized like any other: its teacher is
its windowed softmax; the student is the usual hybrid (window softmax + linear attention over all
older keys). Kept softmax layers keep their window in ``HybridCache``. The student's window softmax
does not soft-cap (``ops`` have no soft-capping): for Gemma 2 the attention transfer learns around it.

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
Only families whose adapter is ``linearizable`` (RoPE attention with q/k/v/o projections) are supported.

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
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from ..modules.hybrid_attention import HybridLinearAttention
from ..modules.latent_attention import rotate_half_rope
from .hybrid_cache import HybridCacheLayer, attach_hybrid_layer
from .registry import adapter_for

__all__ = [
    "HybridCache",
    "HybridSelfAttention",
    "HybridSettings",
    "restore_softmax",
    "set_recall",
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


LLAMA_PATHS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}


class HybridSelfAttention(nn.Module):
    """Replacement of one HF attention module; see the module docstring.

    Args:
        original: the HF attention module (its projections and norms are reused, not copied).
        settings: keyword arguments of ``HybridLinearAttention`` (``window``, ``window_kind``,
            ``feature_map``, ``feature_dim``, ``mix_init``, ``linear_weight``, ``execution``).
        paths: role ``"q"``/``"k"``/``"v"``/``"o"`` -> path of the projection inside ``original``
            (default Llama's ``q_proj`` ... ``o_proj``); the top-level modules holding them are kept
            under their names.
        head_dim: per-head width (default ``original.head_dim``).
        sliding_window: the original layer's window, None for global attention (default: the layer's
            ``sliding_window`` attribute if it has one, else its config's).
        cache_kwarg: keyword under which the decoder layer passes the cache.
    """

    def __init__(self, original: nn.Module, settings: HybridSettings, *, paths: dict[str, str] | None = None,
                 head_dim: int | None = None, sliding_window: int | None | str = "auto", cache_kwarg: str = "cache"):
        super().__init__()
        self.paths = dict(paths or LLAMA_PATHS)
        for path in self.paths.values():
            try:
                original.get_submodule(path)
            except AttributeError:
                raise TypeError(f"{type(original).__name__} has no {path}; HybridSelfAttention wraps attention "
                                f"with q/k/v/o projections") from None
        for path in self.paths.values():
            name = path.split(".")[0]
            setattr(self, name, original.get_submodule(name))
        # Qwen3 / Gemma 3 normalise each head of q and k before RoPE; other families have no such norm.
        self.q_norm = getattr(original, "q_norm", None)
        self.k_norm = getattr(original, "k_norm", None)
        self.layer_idx = int(original.layer_idx)
        self.head_dim = int(head_dim or original.head_dim)
        self.scaling = float(getattr(original, "scaling", self.head_dim**-0.5))
        self.softcap = getattr(original, "attn_logit_softcapping", None) or None  # Gemma 2
        if sliding_window == "auto":
            config = getattr(original, "config", None)
            sliding_window = (original.sliding_window if hasattr(original, "sliding_window")
                              else getattr(config, "sliding_window", None))
        # The teacher must reproduce a sliding-window original (Mistral, Gemma's sliding layers) exactly.
        self.softmax_sliding_window = sliding_window or None
        self.cache_kwarg = cache_kwarg
        self.n_heads = self.projection("q").out_features // self.head_dim
        self.n_kv_heads = self.projection("k").out_features // self.head_dim
        self.settings = dict(settings)
        self.hybrid = HybridLinearAttention(
            self.n_heads, self.n_kv_heads, self.head_dim, softmax_scale=self.scaling, **self.settings
        )
        self.mode = "hybrid"
        # The HF module this one replaces, unregistered (its projections are ours already): what
        # ``restore_softmax`` puts back.
        object.__setattr__(self, "original_attention", original)
        self.transfer_hook: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
        # Called as ``score_hook(self, q, k)`` by a softmax-mode forward (after RoPE): lets a caller read the
        # original attention (``softmax_weights``) without keeping every layer's [n, n] weights.
        self.score_hook: Callable[[nn.Module, torch.Tensor, torch.Tensor], None] | None = None

    def projection(self, role: str) -> nn.Module:
        """The ``"q"``, ``"k"``, ``"v"`` or ``"o"`` projection (resolved by path: replacements stay visible)."""
        return self.get_submodule(self.paths[role])

    # ---- pieces ---------------------------------------------------------------------------
    def project(self, hidden_states: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[b, h, n, dh]``, k, v ``[b, g, n, dh]`` after the (Qwen3) head norms and RoPE."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.projection("q")(hidden_states).view(shape)
        k = self.projection("k")(hidden_states).view(shape)
        v = self.projection("v")(hidden_states).view(shape).transpose(1, 2)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        cos, sin = position_embeddings
        if cos.shape[-1] < self.head_dim:  # partial rotary (GPT-NeoX): the first dims rotate
            return rotate_half_rope(q.transpose(1, 2), cos, sin), rotate_half_rope(k.transpose(1, 2), cos, sin), v
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q, k, v

    def softmax_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          key_padding_mask: torch.Tensor | None) -> torch.Tensor:
        """The original causal softmax attention ``[b, h, n, dh]`` (padded queries give zeros)."""
        n = q.shape[2]
        groups = self.n_heads // self.n_kv_heads
        allowed = self.allowed_keys(torch.arange(n, device=q.device), n)[None, None]  # [1, 1, n, n]
        if key_padding_mask is not None:
            # Every query keeps its own key so that padded rows stay finite (they are zeroed below).
            allowed = (allowed & key_padding_mask[:, None, None, :]) | torch.eye(n, dtype=torch.bool, device=q.device)
        if self.softcap is None:
            y = F.scaled_dot_product_attention(
                q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), attn_mask=allowed,
                scale=self.scaling,
            )
        else:  # c·tanh(s / c) on the scaled scores (Gemma 2), then the masked softmax
            scores = self.attention_scores(q, k).masked_fill(~allowed, float("-inf"))  # [b, h, n, n]
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            y = weights @ v.repeat_interleave(groups, dim=1)
        if key_padding_mask is not None:
            y = y * key_padding_mask[:, None, :, None].to(y.dtype)
        return y

    def softmax_weights(self, q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The original attention's weights ``[b, h, r, n]`` (float32) of the queries ``q`` ``[b, h, r, dh]`` at
        positions ``rows`` ``[r]`` over the keys ``k`` ``[b, g, n, dh]``: causal, with the layer's own window,
        scaling and softcap, no padding — the rows of the matrix ``softmax_attention`` multiplies ``v`` with."""
        scores = self.attention_scores(q, k).float()  # [b, h, r, n]
        allowed = self.allowed_keys(rows, k.shape[2])  # [r, n]
        return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)

    def attention_scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Scaled (and, with a softcap, ``c·tanh(s / c)``) scores ``[b, h, r, n]`` of ``q`` ``[b, h, r, dh]`` against
        the kv heads ``k`` ``[b, g, n, dh]``, unmasked."""
        scores = q @ k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1).transpose(-1, -2) * self.scaling
        return scores if self.softcap is None else torch.tanh(scores / self.softcap) * self.softcap

    def allowed_keys(self, rows: torch.Tensor, n_keys: int) -> torch.Tensor:
        """Bool ``[r, n_keys]``: the keys the original attention lets the queries at positions ``rows`` see
        (causal, within the layer's own sliding window when it has one)."""
        positions = torch.arange(n_keys, device=rows.device)
        allowed = positions[None, :] <= rows[:, None]
        if self.softmax_sliding_window:
            allowed = allowed & (positions[None, :] > rows[:, None] - self.softmax_sliding_window)
        return allowed

    def _output(self, y: torch.Tensor) -> torch.Tensor:
        b, _, n, _ = y.shape
        return self.projection("o")(y.transpose(1, 2).reshape(b, n, self.n_heads * self.head_dim))

    # ---- HF entry point -------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        """HF attention signature; returns ``(output [b, n, d], None)``."""
        if position_embeddings is None:
            raise ValueError("HybridSelfAttention needs the rotary position_embeddings HF passes to attention layers")
        kwargs.pop("past_key_values", None)
        if self.cache_kwarg != "cache":
            cache = kwargs.pop(self.cache_kwarg, None) if cache is None else cache
        q, k, v = self.project(hidden_states, position_embeddings)
        key_padding_mask = key_padding_from_attention_mask(attention_mask, q.shape[2])
        if self.transfer_hook is not None or self.mode == "softmax":
            if cache is not None:
                raise ValueError("softmax/transfer mode of HybridSelfAttention runs without a cache")
            if self.score_hook is not None:
                self.score_hook(self, q, k)
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
        (none with ``linear_weight="zero"``; s = ``hybrid.buffer_size``, from the window kind) + sink k, v
        ``2·b·g·S·dh`` + sparse cache k, v and errors ``b·g·M·(2 dh + 1)`` with its scoring state
        ``b·h·F·(dh + 1)`` when ``M > 0``; bookkeeping tensors (positions, flags, counts) aside."""
        ring = self.hybrid.buffer_size
        features = self.hybrid.feature_map_q.output_dim
        sinks, cached = self.hybrid.recall.sinks, self.hybrid.recall.sparse_cache
        linear = self.n_heads * features * (self.head_dim + 1)
        history = linear if self.hybrid.linear_weight != "zero" else 0
        per_row = (2 * self.n_kv_heads * (ring + sinks) * self.head_dim + history
                   + self.n_kv_heads * cached * (2 * self.head_dim + 1) + (linear if cached else 0))
        return batch_size * per_row

    def state_bytes(self, batch_size: int = 1) -> int:
        """Bytes of this layer's decode state for ``batch_size`` sequences, every tensor included, in the
        dtypes it is really kept in: k, v in the projections' dtype, S, z in float32 (or float64) —
        see ``HybridLinearAttention.state_bytes``."""
        return self.hybrid.state_bytes(batch_size, next(self.projection("k").parameters()).dtype)

    def attention_macs_per_token(self, context: int) -> int:
        """q·k and p·v over the window, sinks and sparse cache plus phi_q^T S and the state update (none with
        ``linear_weight="zero"``; bounded in the context)."""
        ring = self.hybrid.buffer_size + self.hybrid.recall.sinks + self.hybrid.recall.sparse_cache
        features = self.hybrid.feature_map_q.output_dim if self.hybrid.linear_weight != "zero" else 0
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
        wrapper = HybridSelfAttention(original, settings, **_family_options(adapter, model, original))
        wrapper.hybrid.to(device=parameter.device, dtype=parameter.dtype)
        _set_attention(layer, adapter.attention_path, wrapper)
        replaced.append(index)
    return replaced


def set_recall(model: nn.Module, sinks: int, sparse_cache: int) -> list[int]:
    """Give every hybrid layer ``sinks`` attention sinks and a ``sparse_cache`` of that many keys per kv head
    (training-free: no weight depends on them; saved with the model). Returns the hybrid layer indices."""
    modules = hybrid_attention_modules(model)
    if not modules:
        raise ValueError("the model has no hybrid attention layers: sinks and a sparse cache need a linearized model")
    for module in modules.values():
        module.hybrid.set_recall(sinks, sparse_cache)
        module.settings.update(sinks=int(sinks), sparse_cache=int(sparse_cache))
    return sorted(modules)


def restore_softmax(model: nn.Module, layers) -> list[int]:
    """Put the original softmax attention back in the hybrid ``layers`` (with their current projections);
    the model then saves, loads and caches like one linearized with those layers in ``keep_softmax_layers``."""
    adapter = adapter_for(model, capability="linearize")
    decoder_layers = adapter.decoder_layers(model)
    restored = []
    for index in sorted(set(int(i) for i in layers)):
        if not 0 <= index < len(decoder_layers):
            raise ValueError(f"layer {index} out of range: the model has {len(decoder_layers)} layers")
        module = adapter.attention(decoder_layers[index])
        if not isinstance(module, HybridSelfAttention):
            raise ValueError(f"layer {index} has no hybrid attention to restore")
        original = module.original_attention
        for path in module.paths.values():  # a projection replaced since the swap (LoRA, compression) stays
            name = path.split(".")[0]
            setattr(original, name, getattr(module, name))
        _set_attention(decoder_layers[index], adapter.attention_path, original)
        restored.append(index)
    return restored


def _family_options(adapter, model: nn.Module, original: nn.Module) -> dict:
    """HybridSelfAttention's family arguments, from the adapter (paths, head size, window, cache keyword)."""
    return {"paths": {role: adapter.attention_relative_path(role) for role in ("q", "k", "v", "o")},
            "head_dim": adapter.attention_layout(model).head_dim, "sliding_window": adapter.sliding_window(original),
            "cache_kwarg": adapter.cache_kwarg}


def _set_attention(layer: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = layer.get_submodule(parent_path) if parent_path else layer
    setattr(parent, attr, module)


def hybrid_attention_modules(model: nn.Module) -> dict[int, HybridSelfAttention]:
    """Layer index -> hybrid attention module, for every swapped layer of ``model``."""
    return {m.layer_idx: m for m in model.modules() if isinstance(m, HybridSelfAttention)}


def build_from_spec(spec: dict, original: nn.Module, model: nn.Module) -> HybridSelfAttention:
    """Rebuild a saved wrapper around the fresh ``model``'s attention module ``original`` (weights are
    loaded after); fused projections are split first, as in the saved model."""
    adapter = adapter_for(model)
    adapter.decoder_layers(model)
    return HybridSelfAttention(original, spec["settings"], **_family_options(adapter, model, original))


class HybridCache(Cache):
    """Cache for a linearized model: ``HybridCacheLayer`` for hybrid layers, ``DynamicLayer`` (sliding
    layers: ``DynamicSlidingWindowLayer``) otherwise.

    Pass it to ``generate(..., cache=HybridCache(model))`` or ``model(..., cache=...)``.

    Args:
        model: the (partly) linearized causal LM; the hybrid layers are found from its modules.
    """

    def __init__(self, model: nn.Module):
        adapter = adapter_for(model)
        hybrid = set(hybrid_attention_modules(model))
        layers = []
        for index, layer in enumerate(adapter.decoder_layers(model)):
            if index in hybrid:
                layers.append(HybridCacheLayer())
            elif window := adapter.sliding_window(adapter.attention(layer)):
                layers.append(DynamicSlidingWindowLayer(sliding_window=window))  # a kept layer keeps its window
            else:
                layers.append(DynamicLayer())
        super().__init__(layers=layers)

    def state_nbytes(self) -> int:
        """Bytes of all hybrid states (constant in the number of tokens seen)."""
        return sum(layer.nbytes() for layer in self.layers if isinstance(layer, HybridCacheLayer))
