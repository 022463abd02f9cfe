"""HF cache layer for hybrid (LoLCATs) attention: a constant-size decode state per layer.

``HybridCacheLayer`` holds one layer's ``HybridRecurrentState`` (window ring buffer + S, z; see
``retrofitter.ops.hybrid_recurrent``) instead of growing key/value tensors. Its size depends on the
batch, window and feature sizes only, never on the number of tokens seen. It also counts the key
columns seen (``get_seq_length``, padding included) so that HF builds masks and positions exactly
as with a ``DynamicCache``.

This file knows nothing of the attention module; ``adapters.hybrid_attention`` imports it (one way)
and defines the model-level ``HybridCache``. Plain ``generate()`` works too: HF creates a
``DynamicCache`` and each hybrid attention module adopts its (still empty) layer slot on first use
(``attach_hybrid_layer``).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from ..ops.hybrid_recurrent import HybridRecurrentState

__all__ = ["HybridCacheLayer", "attach_hybrid_layer"]


class HybridCacheLayer(CacheLayerMixin):
    """One hybrid attention layer's decode cache: ``state`` (or None before prefill) + columns seen."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False  # nothing to pre-allocate: the state is created by the prefill

    def __init__(self, **kwargs):
        super().__init__()
        self.state: HybridRecurrentState | None = None
        self.seen_tokens = 0  # key columns seen, padding included (what HF's masks count)
        self.is_initialized = True
        self.device = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError("a HybridCacheLayer holds a recurrent state, not keys/values: the layer is a hybrid "
                        "attention layer but was called as softmax attention")

    def store(self, state: HybridRecurrentState, new_columns: int) -> None:
        """Record the state after ``new_columns`` more tokens (real or padding)."""
        self.state = state
        self.seen_tokens += int(new_columns)
        self.device = state.kv_state.device

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        """Bytes held by the state (0 before the prefill)."""
        return 0 if self.state is None else self.state.nbytes()

    def _map_state(self, fn) -> None:
        if self.state is not None:
            tensors = {name: fn(t) for name, t in self.state.tensors().items()}
            self.state = HybridRecurrentState(**tensors, window_kind=self.state.window_kind, window=self.state.window)

    def offload(self):
        self._map_state(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.device is not None:
            self._map_state(lambda t: t.to(self.device, non_blocking=True))

    def reset(self) -> None:
        self.state = None
        self.seen_tokens = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self.state = self.state.select_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            rows = self.state.num_tokens.shape[0]
            index = torch.arange(rows, device=self.state.num_tokens.device).repeat_interleave(repeats)
            self.state = self.state.select_batch(index)

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a hybrid attention state cannot be cropped (tokens are folded into S, z); "
                         "assisted/speculative decoding is not supported")


def attach_hybrid_layer(cache: Cache, layer_idx: int) -> HybridCacheLayer:
    """The ``HybridCacheLayer`` of ``layer_idx`` in ``cache``, adopting an empty slot if needed.

    HF's default ``DynamicCache`` holds ``DynamicLayer`` slots; an empty one is replaced by a
    ``HybridCacheLayer``. A slot that already holds keys/values cannot be converted.
    """
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"hybrid attention needs a transformers Cache with per-layer slots; got {type(cache).__name__}")
    while len(layers) <= layer_idx:
        factory = getattr(cache, "layer_class_to_replicate", None)
        layers.append(factory() if factory is not None else DynamicLayer())
    slot = layers[layer_idx]
    if isinstance(slot, HybridCacheLayer):
        return slot
    seen = slot.get_seq_length() if hasattr(slot, "get_seq_length") else 0
    if seen:
        raise ValueError(f"cache layer {layer_idx} already holds {seen} softmax keys/values; "
                         "it cannot continue as a hybrid attention state")
    layers[layer_idx] = HybridCacheLayer()
    return layers[layer_idx]

