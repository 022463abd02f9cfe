"""The loop's handed objects: statistics sources (one per ``config.statistics``) and layer sources."""

import torch
from torch import nn

from retrofitter.adapters import adapter_for
from retrofitter.config.compress import STATISTICS
from retrofitter.linalg.moments import CrossMomentAccumulator, SecondMomentAccumulator
from retrofitter.pipelines.calibration import capture_stream
from retrofitter.pipelines.input_statistics import InputMoments, PairedInputMoments
from retrofitter.pipelines.layer_sources import LayerSource, ResidentLayers
from retrofitter.pipelines.offload import LayerOffload
from retrofitter.pipelines.statistics_sources import STATISTICS_SOURCES, statistics_source

from tiny_models import TINY_VOCAB, build_tiny


def test_every_statistics_setting_has_a_source():
    assert set(STATISTICS_SOURCES) == set(STATISTICS)


def test_both_layer_sources_implement_the_protocol():
    members = [n for n in LayerSource.__dict__ if not n.startswith("_")] + ["weights_resident"]
    for source in (ResidentLayers, LayerOffload):
        assert all(hasattr(source, name) for name in members), source


def _paired_with_equal_streams(x: torch.Tensor) -> PairedInputMoments:
    moment, cross = SecondMomentAccumulator(x.shape[-1]), CrossMomentAccumulator(x.shape[-1], x.shape[-1])
    moment.update(x)
    cross.update(x, x)
    return PairedInputMoments(moment, x.reshape(-1, x.shape[-1]).double().mean(0), cross)


def test_teacher_targets_of_equal_streams_are_the_plain_statistics():
    """x_t = x_c: W̃ = W, the same metric and the same compensated bias as plain moments."""
    torch.manual_seed(0)
    x = torch.randn(4, 16, 6) + 0.5
    linear = nn.Linear(6, 5)
    plain = InputMoments(SecondMomentAccumulator(6))
    plain.accumulator.update(x)
    paired = _paired_with_equal_streams(x)
    B, A = torch.randn(5, 2, dtype=torch.float64), torch.randn(2, 6, dtype=torch.float64)
    for centered in (False, True):
        torch.testing.assert_close(paired.moment(centered), plain.moment(centered))
        torch.testing.assert_close(paired.target(linear.weight, centered, 1e-2),
                                   plain.target(linear.weight, centered, 1e-2).double())
    torch.testing.assert_close(paired.compensated_bias(linear, B, A), plain.compensated_bias(linear, B, A))
    assert plain.compensated_bias(nn.Linear(6, 5, bias=False), B, A) is None


def test_teacher_target_layer_pairs_equal_the_plain_inputs_on_layer_0():
    """Both streams start as the captured one: layer 0's paired inputs are the plain ones, and the teacher
    source advances both streams (checkpointed as two files)."""
    model = build_tiny("llama").eval()
    adapter = adapter_for(model)
    ids = torch.randint(3, TINY_VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
    stream = capture_stream(model, adapter, ids, 2)
    layer = adapter.decoder_layers(model)[0]
    modules = {"gate": adapter.get_linear(layer, "gate")}
    plain = statistics_source("compressed", stream).for_layer(adapter, layer, 0)
    source = statistics_source("teacher_target", stream)
    paired = source.for_layer(adapter, layer, 0)
    # The teacher's copy of the layer on the cloned stream and the layer on the stream are the same float32
    # computation on equal values, but in other allocations: MKL may pick another kernel path by alignment, so
    # they agree to float32 rounding through one decoder layer of width 64 (~1e-6 relative), not bitwise.
    close = dict(rtol=1e-5, atol=1e-5)
    for (x_t, x_c), (y_t, y_c) in zip(paired.input_pairs(modules), plain.input_pairs(modules)):
        torch.testing.assert_close(x_t["gate"], x_c["gate"], **close)
        torch.testing.assert_close(x_c["gate"], y_c["gate"], **close)
        assert y_t is y_c
    assert paired.passes == plain.passes == 1
    source.advance(paired)
    assert set(source.streams()) == {"stream", "teacher_stream"}
    streams = source.streams()
    assert len(streams["stream"].hidden) == len(streams["teacher_stream"].hidden) == 2
    for a, b in zip(streams["stream"].hidden, streams["teacher_stream"].hidden):
        torch.testing.assert_close(a, b, **close)
