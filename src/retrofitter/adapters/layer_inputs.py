"""What HF hands each decoder layer, captured once per calibration batch (used by ``ModelAdapter``).

``capture_layer_inputs(model, layers, input_ids, per_layer)`` runs the model's embedding, mask and
rotary code and returns the hidden states entering layer 0 [b, n, d] and the keyword arguments of the
decoder layers (attention mask, position embeddings, position ids, ...).

* ``per_layer=False`` (one layer type): a pre-hook on layer 0 grabs its inputs and stops the pass;
  every layer receives the same kwargs.
* ``per_layer=True`` (several ``config.layer_types``, Gemma 2/3): each layer's forward is replaced by a
  recorder for one pass (the layers do not run), so the kwargs of every layer are seen; a keyword whose
  value differs between layers (the sliding vs global mask, Gemma 3's two rotary tables) becomes a
  ``PerLayer``, and every decoder layer gets (once) a forward pre-hook that replaces ``PerLayer``
  values by its own. A pipeline can then call any layer as ``layer(hidden, **kwargs)``; a normal
  forward (plain tensors) passes the hook untouched.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

__all__ = ["PerLayer", "capture_layer_inputs"]


class PerLayer:
    """One keyword argument's value for each decoder layer (``values[i]``: layer i), see the module docstring."""

    def __init__(self, values):
        self.values = tuple(values)

    def __repr__(self) -> str:
        return f"PerLayer({len(self.values)} layers)"


def capture_layer_inputs(model: nn.Module, layers: nn.ModuleList, input_ids: torch.Tensor,
                         per_layer: bool) -> tuple[torch.Tensor, dict]:
    """(hidden [b, n, d] entering layer 0, kwargs of the decoder layers); see the module docstring."""
    if per_layer:
        return _capture_per_layer_inputs(model, layers, input_ids)
    captured: dict = {}

    def grab(_module, args, kwargs):
        captured["hidden"] = args[0] if args else kwargs.pop("hidden_states")
        captured["kwargs"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        raise _StopForward

    handle = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        model(input_ids=input_ids, use_cache=False)
    except _StopForward:
        pass
    finally:
        handle.remove()
    return captured["hidden"], captured["kwargs"]


class _StopForward(Exception):
    """Raised by a hook to stop a forward pass once the first layer's inputs are captured."""


# decoder layer -> handle of its PerLayer-resolving pre-hook (installed once per layer)
_RESOLVERS: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()


def _capture_per_layer_inputs(model: nn.Module, layers: nn.ModuleList, input_ids: torch.Tensor) -> tuple:
    """(hidden [b, n, d] entering layer 0, kwargs) where every keyword argument that differs between layers
    is a ``PerLayer``. The layers do not run: each one's forward is replaced by a recorder for the pass."""
    seen: list[dict] = []
    captured: dict = {}

    def recorder(index: int):
        def forward(*args, **kwargs):
            hidden = args[0] if args else kwargs.pop("hidden_states")
            if index == 0:
                captured["hidden"] = hidden
            seen.append({k: v for k, v in kwargs.items() if k != "hidden_states"})
            if index == len(layers) - 1:
                raise _StopForward
            return hidden
        return forward

    own = [layer.__dict__.get("forward") for layer in layers]  # an instance-level forward (rare) is restored
    for index, layer in enumerate(layers):
        layer.forward = recorder(index)
    try:
        model(input_ids=input_ids, use_cache=False)
    except _StopForward:
        pass
    finally:
        for layer, forward in zip(layers, own):
            del layer.forward
            if forward is not None:
                layer.forward = forward
    kwargs = {}
    for key, value in seen[0].items():
        values = [entry.get(key) for entry in seen]
        kwargs[key] = value if all(v is value for v in values) else PerLayer(values)
    if any(isinstance(v, PerLayer) for v in kwargs.values()):
        for index, layer in enumerate(layers):
            if layer not in _RESOLVERS:
                _RESOLVERS[layer] = layer.register_forward_pre_hook(_PerLayerResolver(index), with_kwargs=True)
    return captured["hidden"], kwargs


class _PerLayerResolver:
    """Pre-hook of decoder layer ``index``: replace every ``PerLayer`` keyword argument by its own value
    (a class, not a closure, so that models carrying it can still be pickled)."""

    def __init__(self, index: int):
        self.index = index

    def __call__(self, _module, args, kwargs):
        if not any(isinstance(v, PerLayer) for v in kwargs.values()):
            return None
        return args, {k: v.values[self.index] if isinstance(v, PerLayer) else v for k, v in kwargs.items()}
