"""Where the sequential loop's statistics come from (``CompressConfig.statistics``; pipelines/sequential.py).

A statistics source owns the calibration stream(s) between layers. The loop asks it, per layer l:

    for_layer(l)   the layer's statistics (pipelines/layer_statistics.py), which the strategy's passes go
                   through: what a fit reads of an input, the (x_t, x_c) input pairs, the teacher's copy
    advance(...)   the stream(s) entering layer l + 1, once layer l is fitted
    streams()      the streams to checkpoint after the layer (file name -> stream; ``restore`` on resume)

The sources (what the fits read; the stream after layer l):

* :class:`CompressedSource` (``"compressed"``): E[x xᵀ] of the compressed model's inputs; the stream
  advances through the compressed layer.
* :class:`TeacherSource` (``"teacher"``): E[x xᵀ] of the original model's inputs; the stream becomes the
  original layer's outputs, kept by the first whole-layer pass made before any projection was replaced.
* :class:`TeacherTargetSource` (``"teacher_target"``): C_cc, μ_t and C_tc of the compressed and the original
  model's inputs side by side; the teacher stream starts as a clone of the captured one and advances
  through a copy of the original layer, the compressed stream through the compressed layer.
* :class:`PrecomputedSource` (``precomputed=`` of the loop): the accumulators given; no stream flows.

:data:`STATISTICS_SOURCES` maps each ``config.statistics`` value to its source class; :func:`statistics_source`
picks the one of a run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from torch import nn

from ..adapters import ModelAdapter
from .calibration import LayerStream
from .distributed import SINGLE_PROCESS, DataParallel
from .layer_statistics import PairedStatistics, PrecomputedStatistics, StreamStatistics, TeacherStatistics

__all__ = ["StatisticsSource", "CompressedSource", "TeacherSource", "TeacherTargetSource", "PrecomputedSource",
           "STATISTICS_SOURCES", "statistics_source"]


class StatisticsSource(Protocol):
    """Where layer l's statistics come from, and how the stream(s) move on after it (module docstring)."""

    def for_layer(self, adapter: ModelAdapter, layer: nn.Module, index: int) -> StreamStatistics: ...

    def advance(self, statistics: StreamStatistics) -> None: ...  # after the layer's fit: the next layer's input

    def streams(self) -> dict[str, LayerStream]: ...  # checkpoint file name -> stream at the next boundary

    def restore(self, streams: dict[str, LayerStream]) -> None: ...  # those streams, read back on resume


class CompressedSource:
    """``statistics="compressed"``: layer l is calibrated on the outputs of the compressed layers < l."""

    def __init__(self, stream: LayerStream, parallel: DataParallel = SINGLE_PROCESS):
        self.stream, self.parallel = stream, parallel

    def streams(self) -> dict[str, LayerStream]:
        return {"stream": self.stream}

    def restore(self, streams: dict[str, LayerStream]) -> None:
        self.stream = streams["stream"]

    def for_layer(self, adapter: ModelAdapter, layer: nn.Module, index: int) -> StreamStatistics:
        return StreamStatistics(adapter, layer, index, self.stream, self.parallel)

    def advance(self, statistics: StreamStatistics) -> None:
        self.stream = self.stream.advance(statistics.layer)  # through the compressed layer


class TeacherSource(CompressedSource):
    """``statistics="teacher"``: layer l is calibrated on the original model's activations."""

    def for_layer(self, adapter: ModelAdapter, layer: nn.Module, index: int) -> TeacherStatistics:
        return TeacherStatistics(adapter, layer, index, self.stream, self.parallel)

    def advance(self, statistics: TeacherStatistics) -> None:
        if statistics.teacher_outputs is None:
            raise RuntimeError(f"layer {statistics.index}: the strategy replaced projections before any pass over "
                               f"the stream, so the original layer's outputs were never computed")
        self.stream = statistics.teacher_outputs


class TeacherTargetSource(CompressedSource):
    """``statistics="teacher_target"``: fits reproduce the original model's outputs from the compressed model's
    inputs (linalg/teacher_target.py), so both streams flow: one more activation buffer."""

    def __init__(self, stream: LayerStream, parallel: DataParallel = SINGLE_PROCESS):
        super().__init__(stream, parallel)
        self.teacher_stream = stream.clone()  # the original model's inputs of layer 0 are the captured ones

    def streams(self) -> dict[str, LayerStream]:
        return {"stream": self.stream, "teacher_stream": self.teacher_stream}

    def restore(self, streams: dict[str, LayerStream]) -> None:
        self.stream, self.teacher_stream = streams["stream"], streams["teacher_stream"]

    def for_layer(self, adapter: ModelAdapter, layer: nn.Module, index: int) -> PairedStatistics:
        return PairedStatistics(adapter, layer, index, self.stream, self.teacher_stream, self.parallel)

    def advance(self, statistics: PairedStatistics) -> None:
        self.stream = self.stream.advance(statistics.layer)
        self.teacher_stream = self.teacher_stream.advance(statistics.teacher_layer)


class PrecomputedSource:
    """Statistics computed beforehand (layer index -> projection name -> ``SecondMomentAccumulator``, e.g. one
    teacher pass shared by several runs, or pipelines/moment_spill.py): no stream flows through the layers."""

    def __init__(self, precomputed: Mapping[int, dict]):
        self.precomputed = precomputed

    def streams(self) -> dict[str, LayerStream]:
        return {}

    def restore(self, streams: dict[str, LayerStream]) -> None:
        """Nothing to restore."""

    def for_layer(self, adapter: ModelAdapter, layer: nn.Module, index: int) -> PrecomputedStatistics:
        return PrecomputedStatistics(adapter, layer, index, self.precomputed[index])

    def advance(self, statistics: PrecomputedStatistics) -> None:
        """Nothing flows."""


# CompressConfig.statistics -> the source of a run on the calibration stream
STATISTICS_SOURCES = {"compressed": CompressedSource, "teacher": TeacherSource, "teacher_target": TeacherTargetSource}


def statistics_source(statistics: str, stream: LayerStream | None, precomputed: Mapping[int, dict] | None = None,
                      parallel: DataParallel = SINGLE_PROCESS):
    """The source of a run: the precomputed statistics when given (the stream then served the planner only),
    else ``STATISTICS_SOURCES[statistics]`` on the captured ``stream``."""
    if precomputed is not None:
        return PrecomputedSource(precomputed)
    if stream is None:
        raise ValueError("give the calibration blocks or precomputed statistics")
    return STATISTICS_SOURCES[statistics](stream, parallel)
