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

``latent_cache_layer(cache, layer_idx)`` swaps one into any ``DynamicCache`` (the one ``generate()``
builds) at first use of a layer — the sliding kind where HF put a ``DynamicSlidingWindowLayer`` — so
no special cache class is needed; ``get_seq_length`` and the causal masks keep working because the
mask sizes are computed as for HF's own layers. ``adapters.latent_attention`` gives it to every
``LatentAttention`` it builds as the ``cache_layer`` (the module itself knows no HF cache class).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

__all__ = ["LatentCacheLayer", "LatentSlidingWindowCacheLayer", "latent_cache_layer"]


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
    if not isinstance(layer, (LatentCacheLayer, LatentSlidingWindowCacheLayer)):
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
