"""Layer-wise calibration plumbing shared by the pipelines.

``LayerStream`` holds the hidden states entering the current decoder layer for every calibration
batch (plus the per-batch keyword arguments HF passes to decoder layers: masks, rotary embeddings),
so a pipeline can walk the model one layer at a time with bounded memory:
model + one layer's statistics + the calibration activations of one layer boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

from ..adapters import ModelAdapter
from ..linalg.moments import SecondMomentAccumulator

__all__ = ["LayerStream", "capture_stream", "collect_input_moments", "layer_inputs", "layer_pass"]


@dataclass
class LayerStream:
    """Hidden states [b, n, d] per calibration batch and the kwargs each decoder layer receives."""

    hidden: list[torch.Tensor]
    layer_kwargs: list[dict]
    token_count: int = 0
    extra: dict = field(default_factory=dict)

    @torch.no_grad()
    def advance(self, layer: nn.Module) -> "LayerStream":
        """The stream leaving ``layer`` (HF's own decoder-layer forward), a new stream; this one is kept. The same
        computation as ``advance_in_place`` (``_replace_by_outputs``), on a new list."""
        return LayerStream(_replace_by_outputs(layer, list(self.hidden), self.layer_kwargs), self.layer_kwargs,
                           self.token_count)

    @torch.no_grad()
    def advance_in_place(self, layer: nn.Module) -> "LayerStream":
        """The stream leaving ``layer``, each batch's output replacing its input in this stream's list as it is
        made: one batch more than the stream at the peak instead of a second stream. Only for a stream whose list
        no other stream shares."""
        _replace_by_outputs(layer, self.hidden, self.layer_kwargs)
        return self

    @torch.no_grad()
    def run(self, layer: nn.Module) -> None:
        """Run ``layer`` over every batch for its side effects (forward hooks); outputs are dropped."""
        for h, kw in zip(self.hidden, self.layer_kwargs):
            layer(h, **kw)

    def clone(self) -> "LayerStream":
        return LayerStream([h.clone() for h in self.hidden], self.layer_kwargs, self.token_count)


def _replace_by_outputs(layer: nn.Module, hidden: list[torch.Tensor], layer_kwargs: list[dict]) -> list[torch.Tensor]:
    """``hidden`` with each batch replaced by ``layer``'s output on it, in place (each input freed once replaced
    unless another list holds it); ``advance`` and ``advance_in_place`` both run this."""
    for index, kwargs in enumerate(layer_kwargs):
        hidden[index] = _layer_output(layer(hidden[index], **kwargs))
    return hidden


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


class _InputsCaptured(Exception):
    """Raised by a pre-hook once every requested input was seen: the rest of the layer need not run."""


@torch.no_grad()
def layer_inputs(layer: nn.Module, modules: dict[str, nn.Module], hidden: torch.Tensor, kwargs: dict) -> dict:
    """name -> the input [b, n, d] of each of ``modules`` (inside ``layer``) when ``layer`` runs on ``hidden``.

    The layer stops at the last module's input (a forward pre-hook raises once all were seen): the
    q/k/v inputs cost one norm, not a layer. A module the forward never calls is simply absent.
    """
    captured: dict = {}

    def hook(name):
        def record(_module, args):
            captured.setdefault(name, args[0].detach())
            if len(captured) == len(modules):
                raise _InputsCaptured
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in modules.items()]
    try:
        layer(hidden, **kwargs)
    except _InputsCaptured:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return captured


@torch.no_grad()
def layer_pass(layer: nn.Module, stream: LayerStream, modules: dict[str, nn.Module]
               ) -> Iterator[tuple[dict, torch.Tensor]]:
    """Per batch of ``stream``: (name -> the input [b, n, d] of each of ``modules`` (inside ``layer``) at its first
    call, the layer's output [b, n, d]). The whole layer runs (HF's own decoder-layer forward, as
    :meth:`LayerStream.advance`); the hooks are gone before each batch is handed out."""
    for hidden, kwargs in zip(stream.hidden, stream.layer_kwargs):
        captured: dict = {}

        def record(_module, args, name):
            captured.setdefault(name, args[0].detach())

        handles = [m.register_forward_pre_hook(lambda module, args, name=n: record(module, args, name))
                   for n, m in modules.items()]
        try:
            output = _layer_output(layer(hidden, **kwargs))
        finally:
            for handle in handles:
                handle.remove()
        yield captured, output


@torch.no_grad()
def collect_input_moments(layer: nn.Module, stream: LayerStream, modules: dict[str, nn.Module],
                          on_batch: Callable[[int], None] | None = None,
                          keep_outputs: bool = False) -> dict[str, SecondMomentAccumulator]:
    """Second moments of the inputs of ``modules`` (name -> module inside ``layer``) over ``stream``.

    Runs the layer over every batch; returns name -> accumulator. Modules that share an input should
    be passed once (one accumulator per distinct input). Without ``keep_outputs`` each batch stops at
    the last requested input (:func:`layer_inputs`); with it the whole layer runs and its outputs are
    returned too, as ``(accumulators, next_stream)``, so a caller that needs both pays for one pass.
    """
    device = _statistics_device(layer)
    accumulators = {name: SecondMomentAccumulator(module.in_features, device=device) for name, module in modules.items()}
    if not keep_outputs:
        for index, (h, kw) in enumerate(zip(stream.hidden, stream.layer_kwargs)):
            for name, x in layer_inputs(layer, modules, h, kw).items():
                accumulators[name].update(x)
            if on_batch is not None:
                on_batch(index)
        return accumulators
    handles = []
    for name, module in modules.items():
        def hook(_module, args, name=name):
            accumulators[name].update(args[0].detach())

        handles.append(module.register_forward_pre_hook(hook))
    outputs = []
    try:
        for index, (h, kw) in enumerate(zip(stream.hidden, stream.layer_kwargs)):
            outputs.append(_layer_output(layer(h, **kw)))
            if on_batch is not None:
                on_batch(index)
    finally:
        for handle in handles:
            handle.remove()
    return accumulators, LayerStream(outputs, stream.layer_kwargs, stream.token_count)


def _statistics_device(layer: nn.Module) -> torch.device:
    return next(layer.parameters()).device
