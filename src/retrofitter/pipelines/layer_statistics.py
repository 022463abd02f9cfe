"""What a strategy may ask of the statistics of one decoder layer: passes over the stream entering it.

A statistics source (pipelines/statistics_sources.py) makes one of these per layer; the strategy reaches it
as ``LayerContext.statistics``. Every pass over the calibration stream goes through it (counted in ``passes``):

    collect(modules)      name -> what a fit reads of each module's input (pipelines/input_statistics.py):
                          ``InputMoments``, or ``PairedInputMoments`` for teacher targets
    moments(modules)      name -> ``InputMoments`` of this layer's own inputs, whatever the source (for a
                          fit that keeps its own outputs: o of joint VO, whose input is the attention mix)
    input_pairs(modules)  per calibration batch (inputs_t, inputs_c): name -> the input [b, n, d] of each
                          module when the original layer runs on the teacher's stream, and when this layer
                          runs on its own; the same tensors for every kind but teacher targets
    run()                 one pass of the layer, for the forward hooks the caller registered
    synchronize(...)      accumulators a strategy filled itself, totalled over the processes

Kinds: :class:`StreamStatistics` (the stream entering this layer: ``statistics="compressed"``),
:class:`TeacherStatistics` (the original model's stream; the first whole-layer pass made before any
projection is replaced keeps the layer's outputs, the next layer's stream: ``"teacher"``),
:class:`PairedStatistics` (a copy of the original layer on the original model's stream beside this layer
on the compressed one: ``"teacher_target"``), :class:`PrecomputedStatistics` (accumulators computed
beforehand; no stream).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..adapters import ModelAdapter
from ..linalg.moments import CrossMomentAccumulator, SecondMomentAccumulator
from .calibration import LayerStream, collect_input_moments, layer_inputs, layer_pass
from .distributed import SINGLE_PROCESS, DataParallel
from .input_statistics import InputMoments, PairedInputMoments

__all__ = ["StreamStatistics", "TeacherStatistics", "PairedStatistics", "PrecomputedStatistics"]


class StreamStatistics:
    """Passes of decoder layer ``index`` over ``stream`` (its inputs per calibration batch)."""

    def __init__(self, adapter: ModelAdapter, layer: nn.Module, index: int, stream: LayerStream | None,
                 parallel: DataParallel = SINGLE_PROCESS):
        self.adapter, self.layer, self.index, self.stream, self.parallel = adapter, layer, index, stream, parallel
        self.originals = {name: adapter.get_linear(layer, name) for name in adapter.linear_names}  # before any fit
        self.passes = 0
        self.teacher_outputs: LayerStream | None = None  # the original layer's outputs, when a pass kept them

    def where(self, name: str) -> str:
        return f"layer {self.index} input of {name!r} ({self.adapter.linear_path_in_model(self.index, name)})"

    def collect(self, modules: dict[str, nn.Module]) -> dict:
        """name -> the fit statistics of each of ``modules``' inputs: here their second moments."""
        return self.moments(modules)

    def moments(self, modules: dict[str, nn.Module]) -> dict[str, InputMoments]:
        """One pass: second moments of the inputs of ``modules`` (name -> module), totalled and checked finite."""
        self._need_stream()
        self.passes += 1
        accumulators = self._input_moments(modules)
        for name, accumulator in accumulators.items():
            accumulator.synchronize(self.parallel.all_reduce_sum).check_finite(self.where(name))
        return {name: InputMoments(accumulator) for name, accumulator in accumulators.items()}

    def input_pairs(self, modules: dict[str, nn.Module]):
        """Per batch ``(inputs, inputs)``: name -> the input [b, n, d] of each of ``modules`` (one whole-layer
        pass: the same x on both sides)."""
        self._need_stream()
        self.passes += 1
        for inputs in self._whole_layer(modules):
            yield inputs, inputs

    def run(self) -> None:
        """One pass of the layer over the stream, for the forward hooks the caller registered."""
        self._need_stream()
        self.passes += 1
        for _ in self._whole_layer({}):
            pass

    def synchronize(self, *accumulators) -> None:
        """Moment accumulators (or plain sum tensors) a strategy filled itself, totalled over processes."""
        for accumulator in accumulators:
            if isinstance(accumulator, torch.Tensor):
                self.parallel.all_reduce_sum(accumulator)
            else:
                accumulator.synchronize(self.parallel.all_reduce_sum)

    def _input_moments(self, modules: dict[str, nn.Module]) -> dict[str, SecondMomentAccumulator]:
        return collect_input_moments(self.layer, self.stream, modules)

    def _keeps_outputs(self) -> bool:
        """Whether the pass about to run keeps the layer's outputs as ``teacher_outputs``."""
        return False

    def _whole_layer(self, modules: dict[str, nn.Module]):
        """Per batch: name -> the input of each of ``modules``, the whole layer run (outputs kept if wanted)."""
        keep = self._keeps_outputs()
        outputs = []
        for inputs, output in layer_pass(self.layer, self.stream, modules):
            if keep:
                outputs.append(output)
            yield inputs
        if keep:
            self.teacher_outputs = LayerStream(outputs, self.stream.layer_kwargs, self.stream.token_count)

    def _need_stream(self) -> None:
        if self.stream is None:
            raise ValueError("this strategy needs the calibration stream; precomputed statistics do not suffice")


class TeacherStatistics(StreamStatistics):
    """:class:`StreamStatistics` on the original model's stream; the first whole-layer pass while every projection
    is still the original keeps the layer's outputs (``teacher_outputs``: the next layer's stream)."""

    def _keeps_outputs(self) -> bool:
        unchanged = all(self.adapter.get_linear(self.layer, n) is m for n, m in self.originals.items())
        return self.teacher_outputs is None and unchanged

    def _input_moments(self, modules: dict[str, nn.Module]) -> dict[str, SecondMomentAccumulator]:
        if not self._keeps_outputs():
            return super()._input_moments(modules)  # each batch stops at the last requested input
        accumulators, self.teacher_outputs = collect_input_moments(self.layer, self.stream, modules, keep_outputs=True)
        return accumulators


class PairedStatistics(StreamStatistics):
    """Teacher targets: this layer on the compressed stream beside ``teacher_layer`` (a copy of the original
    layer, made here) on ``teacher_stream``, the original model's inputs of the same tokens."""

    def __init__(self, adapter: ModelAdapter, layer: nn.Module, index: int, stream: LayerStream,
                 teacher_stream: LayerStream, parallel: DataParallel = SINGLE_PROCESS):
        super().__init__(adapter, layer, index, stream, parallel)
        self.teacher_stream = teacher_stream
        self.teacher_layer = copy.deepcopy(layer)  # one more layer of memory, for this layer only

    @torch.no_grad()
    def collect(self, modules: dict[str, nn.Module]) -> dict[str, PairedInputMoments]:
        """One paired pass: per module, C_cc of x_c, μ_t of x_t [d] and C_tc = E[x_t x_cᵀ], totalled and checked."""
        device = next(self.layer.parameters()).device
        stats = {name: (SecondMomentAccumulator(m.in_features, device=device),
                        CrossMomentAccumulator(m.in_features, m.in_features, device=device),
                        torch.zeros(m.in_features, dtype=torch.float64, device=device))
                 for name, m in modules.items()}
        for inputs_t, inputs_c in self.input_pairs(modules):
            for name, (moment, cross, sum_t) in stats.items():
                moment.update(inputs_c[name])
                cross.update(inputs_t[name], inputs_c[name])
                sum_t += inputs_t[name].reshape(-1, sum_t.shape[0]).to(torch.float64).sum(0)
        result = {}
        for name, (moment, cross, sum_t) in stats.items():
            moment.check_finite(self.where(name))
            cross.check_finite(self.where(name))
            self.synchronize(moment, cross, sum_t)
            result[name] = PairedInputMoments(moment, sum_t / cross.count, cross)
        return result

    @torch.no_grad()
    def input_pairs(self, modules: dict[str, nn.Module]):
        """Per batch ``(inputs_t, inputs_c)``: the inputs of ``modules`` when the original layer runs on the
        teacher's stream, and when this layer runs on its own (each stops at the last requested input)."""
        self.passes += 1
        teacher_modules = {name: self.adapter.get_linear(self.teacher_layer, name) for name in modules}
        for h_c, h_t, kwargs in zip(self.stream.hidden, self.teacher_stream.hidden, self.stream.layer_kwargs):
            yield (layer_inputs(self.teacher_layer, teacher_modules, h_t, kwargs),
                   layer_inputs(self.layer, modules, h_c, kwargs))


class PrecomputedStatistics(StreamStatistics):
    """Accumulators computed beforehand (``precomputed``: name -> ``SecondMomentAccumulator``), no stream:
    ``collect`` reads them (no pass); anything that needs a pass raises."""

    def __init__(self, adapter: ModelAdapter, layer: nn.Module, index: int, precomputed: dict):
        super().__init__(adapter, layer, index, None)
        self.precomputed = precomputed

    def collect(self, modules: dict[str, nn.Module]) -> dict[str, InputMoments]:
        return {name: InputMoments(self.precomputed[name]) for name in modules}
