"""HF cache layer for ``LatentAttention`` (modules/latent_attention.py): latents instead of keys/values.

``LatentCacheLayer`` is a ``DynamicLayer`` whose keys are z_k ``[b, 1, N, r_k]`` and values z_v
``[b, 1, N, r_v]`` (one shared latent "head"), plus, for RoPE models, the position id of every cached
token ``[b, N]`` in the dtype the attention hands over (``LatentAttention.position_dtype``). So per
token and layer it holds exactly ``LatentAttention.cache_bytes_per_token()`` bytes.

``LatentSlidingWindowCacheLayer`` is its counterpart for sliding-window layers (Gemma 2/3, Mistral or
Phi-3 with a window): a ``DynamicSlidingWindowLayer`` of latents that keeps the last window − 1 tokens,
exactly as HF keeps dense keys/values, so a sliding layer keeps its window — and a bounded cache —
after conversion. Its positions live in a shadow sliding layer ([b, 1, N, 1] "keys"), so that every
crop / reorder / batch operation treats them exactly like the latents.

``StaticLatentCacheLayer`` is the compile-friendly kind (``StaticLatentCache``): latents and positions
preallocated for ``max_cache_len`` tokens and written in place at a tensor offset, so that a decode step
has the same shapes at every position (``torch.compile`` traces it once, as HF's ``StaticLayer``).

``latent_cache_layer(cache, layer_idx)`` swaps one into any ``DynamicCache`` (the one ``generate()``
builds) at first use of a layer — the sliding kind where HF put a ``DynamicSlidingWindowLayer`` — so
no special cache class is needed; ``get_seq_length`` and the causal masks keep working because the
mask sizes are computed as for HF's own layers. ``adapters.latent_attention`` gives it to every
``LatentAttention`` it builds as the ``cache_layer`` (the module itself knows no HF cache class).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer, StaticLayer

__all__ = ["LatentCacheLayer", "LatentSlidingWindowCacheLayer", "StaticLatentCache", "StaticLatentCacheLayer",
           "latent_cache_layer"]


class LatentCacheLayer(DynamicLayer):
    """DynamicLayer holding keys = z_k [b, 1, N, r_k], values = z_v [b, 1, N, r_v], positions [b, N]."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.positions = None

    def update_latent(self, key_latent, value_latent, positions):
        """Append z_k [b, n, r_k], z_v [b, n, r_v], positions [b | 1, n] (or None, stored as given);
        return all cached: z_k [b, N, r_k], z_v [b, N, r_v], positions [b, N] (or None)."""
        keys, values = self.update(key_latent.unsqueeze(1), value_latent.unsqueeze(1))
        if positions is not None:
            positions = positions.expand(key_latent.shape[0], -1)
            self.positions = positions if self.positions is None else torch.cat([self.positions, positions], -1)
        return keys[:, 0], values[:, 0], self.positions

    def reset(self) -> None:
        super().reset()
        self.positions = None

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if tokens_to_remove < 0 and self.positions is not None:
            self.positions = self.positions[:, :tokens_to_remove]

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.positions is not None:
            self.positions = self.positions.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.positions is not None:
            self.positions = self.positions[indices]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.positions is not None:
            self.positions = self.positions.index_select(0, beam_idx.to(self.positions.device))


class LatentSlidingWindowCacheLayer(DynamicSlidingWindowLayer):
    """Sliding-window cache of latents: keys = z_k [b, 1, ≤ w−1, r_k], values = z_v [b, 1, ≤ w−1, r_v],
    positions [b, ≤ w−1] (HF's ``DynamicSlidingWindowLayer`` semantics, window w)."""

    def __init__(self, sliding_window: int, **kwargs):
        super().__init__(sliding_window=sliding_window, **kwargs)
        self._positions = DynamicSlidingWindowLayer(sliding_window=sliding_window)

    @property
    def positions(self):
        """Cached position ids [b, N] (None before the first update or without RoPE)."""
        if not self._positions.is_initialized or self._positions.keys.numel() == 0:
            return None
        return self._positions.keys[:, 0, :, 0]

    def update_latent(self, key_latent, value_latent, positions):
        """Append z_k [b, n, r_k], z_v [b, n, r_v], positions [b | 1, n] (or None); return what this step
        attends to: the window's cached tokens and the new ones, z_k [b, N, r_k], z_v [b, N, r_v], positions."""
        keys, values = self.update(key_latent.unsqueeze(1), value_latent.unsqueeze(1))
        visible = None
        if positions is not None:
            positions = positions.expand(key_latent.shape[0], -1)[:, None, :, None]  # [b, 1, n, 1]
            visible, _ = self._positions.update(positions, positions[..., :0])
            visible = visible[:, 0, :, 0]
        return keys[:, 0], values[:, 0], visible

    def reset(self) -> None:
        super().reset()
        self._positions.reset()

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self._positions.is_initialized:
            self._positions.crop(tokens_to_remove)

    def activate_past_recording(self):
        super().activate_past_recording()
        self._positions.activate_past_recording()

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._positions.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._positions.batch_select_indices(indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self._positions.is_initialized and self._positions.keys.numel():
            self._positions.reorder_cache(beam_idx)


class StaticLatentCacheLayer(StaticLayer):
    """Preallocated latents: keys = z_k [b, 1, max_cache_len, r_k], values = z_v [b, 1, max_cache_len, r_v],
    positions [b, max_cache_len] (int32, zeros in the slots not written yet: the mask hides them).

    ``update_latent`` writes the new tokens at slots ``cumulative_length + 0..n−1`` (a tensor: no
    recompilation per step) and returns every slot, like HF's ``StaticLayer``; the mask sizes are
    ``(max_cache_len, 0)``.
    """

    def __init__(self, max_cache_len: int, **kwargs):
        super().__init__(max_cache_len=max_cache_len, **kwargs)
        self.positions = None

    def update_latent(self, key_latent, value_latent, positions):
        """Write z_k [b, n, r_k], z_v [b, n, r_v], positions [b | 1, n] (or None) at the next n slots;
        return all slots: z_k [b, L, r_k], z_v [b, L, r_v], positions [b, L] (or None), L = max_cache_len."""
        slots = torch.arange(key_latent.shape[1], device=key_latent.device) + self.cumulative_length.to(
            key_latent.device)  # before update() advances it
        keys, values = self.update(key_latent.unsqueeze(1), value_latent.unsqueeze(1))
        if positions is not None:
            if self.positions is None:
                self.positions = torch.zeros(key_latent.shape[0], self.max_cache_len, dtype=positions.dtype,
                                             device=key_latent.device)
                if not torch.compiler.is_compiling():
                    torch._dynamo.mark_static_address(self.positions)
            self.positions.index_copy_(1, slots, positions.expand(key_latent.shape[0], -1))
        return keys[:, 0], values[:, 0], self.positions

    def reset(self) -> None:
        super().reset()
        if self.positions is not None:
            self.positions.zero_()


class StaticLatentCache(Cache):
    """Model-level cache of ``StaticLatentCacheLayer``s (one per decoder layer), for ``torch.compile``d decode.

    Only for models whose attention layers are all global (a sliding-window layer keeps a bounded
    dynamic cache instead: ``LatentSlidingWindowCacheLayer``).
    """

    def __init__(self, num_layers: int, max_cache_len: int):
        super().__init__(layers=[StaticLatentCacheLayer(max_cache_len) for _ in range(num_layers)])


def latent_cache_layer(cache, layer_index: int) -> LatentCacheLayer | LatentSlidingWindowCacheLayer:
    """The LatentCacheLayer of ``layer_index`` in ``cache`` (a DynamicCache), installed at first use.

    A ``DynamicSlidingWindowLayer`` slot (HF's sliding layers) becomes a ``LatentSlidingWindowCacheLayer``
    of the same window. Raises ``ValueError`` for caches that already hold dense keys for that layer or
    that are not dynamic (static caches preallocate dense [b, g, N, dh] tensors).
    """
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ValueError(f"LatentAttention needs a transformers Cache with .layers, got {type(cache).__name__}")
    replicate = getattr(cache, "layer_class_to_replicate", None)
    while replicate is not None and len(layers) <= layer_index:
        layers.append(replicate())
    if layer_index >= len(layers):
        raise ValueError(f"cache has {len(layers)} layers, LatentAttention layer {layer_index} has none")
    layer = layers[layer_index]
    if not isinstance(layer, (LatentCacheLayer, LatentSlidingWindowCacheLayer, StaticLatentCacheLayer)):
        if not isinstance(layer, DynamicLayer) or getattr(layer, "is_initialized", False):
            raise ValueError(
                f"layer {layer_index}: cache layer {type(layer).__name__} cannot hold latents (use a fresh "
                "DynamicCache, the default of generate())")
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer = LatentSlidingWindowCacheLayer(sliding_window=layer.sliding_window)
        else:
            layer = LatentCacheLayer()
        layers[layer_index] = layer
    return layer
