"""HF cache layer for hybrid (LoLCATs) attention: a constant-size decode state per layer.

``HybridCacheLayer`` holds one layer's ``HybridRecurrentState`` (window ring buffer + S, z, and the
sinks and sparse cache when set; see ``retrofitter.ops.hybrid_state``) instead of growing key/value tensors. Its size depends on the
batch, window and feature sizes only, never on the number of tokens seen. It also counts the key
columns seen (``get_seq_length``, padding included) so that HF builds masks and positions exactly
as with a ``DynamicCache``.

``StaticHybridCacheLayer`` (model level: ``StaticHybridCache``) is the compile-friendly kind for decode
steps under ``torch.compile``: after the prefill the state is updated in place (fixed addresses), the
columns seen are a tensor, and the mask it asks HF for covers only the new tokens (``(n, 0)``: the
state holds everything older), so every step has the same shapes. Padding cannot be told apart in
that mask once the prefill is over: decode steps must be given no ``attention_mask`` (all real).

This file knows nothing of the attention module; ``adapters.hybrid_attention`` imports it (one way)
and defines the model-level ``HybridCache``. Plain ``generate()`` works too: HF creates a
``DynamicCache`` and each hybrid attention module adopts its (still empty) layer slot on first use
(``attach_hybrid_layer``).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from ..ops.hybrid_recurrent import HybridRecurrentState

__all__ = ["HybridCacheLayer", "StaticHybridCache", "StaticHybridCacheLayer", "attach_hybrid_layer"]


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
            self.state = self.state.with_tensors(**tensors)

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


class StaticHybridCacheLayer(HybridCacheLayer):
    """A ``HybridCacheLayer`` whose state is overwritten in place after the prefill and whose column count
    is a tensor, so a compiled decode step sees fixed shapes and addresses (see the module docstring).
    ``reset()`` keeps the buffers: the next prefill writes into them."""

    is_compileable = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen_tokens = torch.tensor(0, dtype=torch.long)

    @property
    def state(self) -> HybridRecurrentState | None:
        """The live state (None before the prefill, as for ``HybridCacheLayer``)."""
        return self._buffers_state if self._live else None

    @state.setter
    def state(self, value: HybridRecurrentState | None) -> None:  # HybridCacheLayer.__init__ sets None
        self._buffers_state, self._live = value, value is not None

    def store(self, state: HybridRecurrentState, new_columns: int) -> None:
        if self._buffers_state is None:  # first prefill: its tensors become the fixed buffers
            self._buffers_state = state
            self.seen_tokens = self.seen_tokens.to(state.kv_state.device)
            self.device = state.kv_state.device
            if not torch.compiler.is_compiling():
                for tensor in (*state.tensors().values(), self.seen_tokens):
                    torch._dynamo.mark_static_address(tensor)
        elif state is not self._buffers_state:
            for name, tensor in state.tensors().items():
                getattr(self._buffers_state, name).copy_(tensor)
        self._live = True
        self.seen_tokens.add_(int(new_columns))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # the new tokens only: their causal block is all HF's mask needs to give

    def reset(self) -> None:
        self._live = False
        self.seen_tokens.zero_()


class StaticHybridCache(Cache):
    """Model-level cache of ``StaticHybridCacheLayer``s, for a model whose every layer is hybrid."""

    def __init__(self, num_layers: int):
        super().__init__(layers=[StaticHybridCacheLayer() for _ in range(num_layers)])


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

