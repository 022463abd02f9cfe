"""Where the sequential loop's decoder layers come from (pipelines/sequential.py hands it a :class:`LayerSource`).

Two sources implement the protocol:

    ResidentLayers   the model is in memory: nothing to read or free; every layer's weights are checked
                     before any work, a resumed run loads the finished layers from the checkpoint, and the
                     MLP pivots are led once at the end over the whole model
    LayerOffload     (pipelines/offload.py) the model is on the meta device: each layer is read from the
                     safetensors shards before its fit (and checked then), freed after its checkpoint; a
                     resumed run rebuilds the finished layers' structure only, and each layer's MLP pivots
                     are led before the layer is saved (it leaves memory after)

The loop calls, in order: ``check_run`` (refuse what the source cannot serve), ``capturing()`` around the
capture of layer 0's inputs, then per layer ``onload``, ``check_onloaded``, the fit, ``lead_layer_pivots``,
the checkpoint, ``release``; finally ``lead_remaining_pivots``. ``weights_resident`` tells
``check_compressible`` whether to check every layer up front and ``restore_layers`` whether to load the
finished layers' weights (pipelines/layer_checkpoint.py).
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Protocol

import torch
from torch import nn

from ..adapters import ModelAdapter
from ..adapters.mlp_permutation import lead_mlp_pivots

__all__ = ["LayerSource", "ResidentLayers", "check_layer_weights"]


class LayerSource(Protocol):
    """Where the decoder layers' tensors come from and go to (module docstring)."""

    weights_resident: bool  # every layer in memory from the start: checked up front, loaded back on resume

    def check_run(self, calibration: torch.Tensor | None, checkpoint_dir) -> None: ...  # raise what cannot run

    def capturing(self) -> ContextManager: ...  # the modules before layer 0, present during the input capture

    def onload(self, index: int, layer: nn.Module) -> None: ...  # layer's tensors in memory, on the device

    def check_onloaded(self, adapter: ModelAdapter, index: int, layer: nn.Module, targets: list[str]) -> None: ...

    def lead_layer_pivots(self, model: nn.Module, index: int) -> dict: ...  # report fields of layer ``index``

    def release(self, index: int, layer: nn.Module) -> None: ...  # the layer's memory, after its checkpoint

    def lead_remaining_pivots(self, model: nn.Module, layer_reports: list[dict]) -> int: ...  # MLPs with leading pivots


class ResidentLayers:
    """The :class:`LayerSource` of a model held in memory: every step is a no-op except the final pivots."""

    weights_resident = True

    def check_run(self, calibration: torch.Tensor | None, checkpoint_dir) -> None:
        """Anything runs in memory."""

    def capturing(self) -> ContextManager:
        return contextlib.nullcontext()

    def onload(self, index: int, layer: nn.Module) -> None:
        """Already in memory."""

    def check_onloaded(self, adapter: ModelAdapter, index: int, layer: nn.Module, targets: list[str]) -> None:
        """Checked before the loop (``check_compressible`` with ``weights=True``)."""

    def lead_layer_pivots(self, model: nn.Module, index: int) -> dict:
        return {}  # led once at the end, over the whole model

    def release(self, index: int, layer: nn.Module) -> None:
        """Kept: the compressed model is the result."""

    def lead_remaining_pivots(self, model: nn.Module, layer_reports: list[dict]) -> int:
        return lead_mlp_pivots(model)  # exact; lets down projections slice instead of gather


def check_layer_weights(adapter: ModelAdapter, layer: nn.Module, index: int, targets: list[str]) -> None:
    """Every target of ``layer`` is a dense ``nn.Linear`` with finite weights."""
    for name in targets:
        linear = adapter.get_linear(layer, name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"layer {index} projection {name!r} is a {type(linear).__name__} already: this model "
                             f"was converted before; compress the original model instead")
        if not torch.isfinite(linear.weight).all():
            raise ValueError(f"non-finite values (NaN/Inf) in the weights of layer {index} projection {name!r} "
                             f"({adapter.linear_path_in_model(index, name)})")
