"""Layer-wise calibration plumbing shared by the pipelines.

``LayerStream`` holds the hidden states entering the current decoder layer for every calibration
batch (plus the per-batch keyword arguments HF passes to decoder layers: masks, rotary embeddings),
so a pipeline can walk the model one layer at a time with bounded memory:
model + one layer's statistics + the calibration activations of one layer boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..adapters import ModelAdapter
from ..linalg.moments import SecondMomentAccumulator

__all__ = ["LayerStream", "capture_stream", "collect_input_moments"]


@dataclass
class LayerStream:
    """Hidden states [b, n, d] per calibration batch and the kwargs each decoder layer receives."""

    hidden: list[torch.Tensor]
    layer_kwargs: list[dict]
    token_count: int = 0
    extra: dict = field(default_factory=dict)

    @torch.no_grad()
    def advance(self, layer: nn.Module) -> "LayerStream":
        """The stream leaving ``layer`` (HF's own decoder-layer forward)."""
        outputs = [_layer_output(layer(h, **kw)) for h, kw in zip(self.hidden, self.layer_kwargs)]
        return LayerStream(outputs, self.layer_kwargs, self.token_count)

    @torch.no_grad()
    def run(self, layer: nn.Module) -> None:
        """Run ``layer`` over every batch for its side effects (forward hooks); outputs are dropped."""
        for h, kw in zip(self.hidden, self.layer_kwargs):
            layer(h, **kw)

    def clone(self) -> "LayerStream":
        return LayerStream([h.clone() for h in self.hidden], self.layer_kwargs, self.token_count)


def _layer_output(output):
    return output[0] if isinstance(output, tuple) else output


@torch.no_grad()
def capture_stream(model: nn.Module, adapter: ModelAdapter, blocks: torch.Tensor, batch_size: int) -> LayerStream:
    """Inputs of the first decoder layer for token ``blocks`` [n_blocks, seq_len]."""
    device = next(model.parameters()).device
    hidden, kwargs = [], []
    for start in range(0, blocks.shape[0], batch_size):
        h, kw = adapter.capture_first_layer_inputs(model, blocks[start:start + batch_size].to(device))
        hidden.append(h)
        kwargs.append(kw)
    return LayerStream(hidden, kwargs, token_count=blocks.numel())


@torch.no_grad()
def collect_input_moments(layer: nn.Module, stream: LayerStream, modules: dict[str, nn.Module],
                          on_batch: Callable[[int], None] | None = None,
                          keep_outputs: bool = False) -> dict[str, SecondMomentAccumulator]:
    """Second moments of the inputs of ``modules`` (name -> module inside ``layer``) over ``stream``.

    Runs the layer once over every batch with forward hooks; returns name -> accumulator. Modules
    that share an input should be passed once (one accumulator per distinct input). With
    ``keep_outputs`` the layer outputs are returned too, as ``(accumulators, next_stream)``, so a
    caller that needs both pays for one forward pass.
    """
    accumulators: dict[str, SecondMomentAccumulator] = {}
    handles = []
    for name, module in modules.items():
        dim = module.in_features
        accumulators[name] = SecondMomentAccumulator(dim, device=_statistics_device(layer))

        def hook(_module, args, _output, name=name):
            accumulators[name].update(args[0].detach())

        handles.append(module.register_forward_hook(hook))
    outputs = []
    try:
        for index, (h, kw) in enumerate(zip(stream.hidden, stream.layer_kwargs)):
            output = _layer_output(layer(h, **kw))
            if keep_outputs:
                outputs.append(output)
            if on_batch is not None:
                on_batch(index)
    finally:
        for handle in handles:
            handle.remove()
    if keep_outputs:
        return accumulators, LayerStream(outputs, stream.layer_kwargs, stream.token_count)
    return accumulators


def _statistics_device(layer: nn.Module) -> torch.device:
    return next(layer.parameters()).device
