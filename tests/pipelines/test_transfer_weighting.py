"""Token weights of the MLA attention transfer (``--transfer-weighting residual-norm``, pipelines/mla_transfer.py):
the weighted error is each token's squared error over its residual stream's squared norm, the weights travel with
the batch's pieces and positions, and the conversion trains on them."""

from __future__ import annotations

import functools

import pytest
import torch

from retrofitter.adapters.mla_attention import attention_kwargs_at
from retrofitter.adapters.registry import adapter_for
from retrofitter.pipelines.calibration import capture_stream
from retrofitter.pipelines.mla import MLAConfig, convert_to_mla
from retrofitter.pipelines.mla_transfer import (at_positions, attention_batches, relative_output_error,
                                               residual_norm_weights, skipped_position_ids)
from tiny_models import TINY_VOCAB, strong_tiny

CALIBRATION = torch.randint(3, TINY_VOCAB, (6, 32), generator=torch.Generator().manual_seed(1))


def _first_layer_batches():
    model = strong_tiny("llama", dtype=torch.float32)
    adapter = adapter_for(model)
    stream = capture_stream(model, adapter, CALIBRATION, 4)
    layer = adapter.decoder_layers(model)[0]
    stream = stream.advance(layer)  # a residual stream with unequal token norms
    return model, layer, stream, attention_batches(layer, layer.self_attn, stream, adapter.cache_kwarg)


def test_residual_norm_weights_make_the_error_relative_to_each_tokens_stream():
    model, layer, stream, batches = _first_layer_batches()
    weighted = residual_norm_weights(batches, stream.hidden)
    noisy = torch.nn.Linear(1, 1)  # any module: here the attention with its output moved by a known amount
    generator = torch.Generator().manual_seed(3)
    shifts = [torch.randn(b.target.shape, generator=generator, dtype=torch.float64) for b in batches]
    outputs = iter([b.target.double() + s for b, s in zip(batches, shifts)] * 2)  # read twice: weighted, plain
    noisy.forward = lambda **kwargs: next(outputs)
    error = relative_output_error(noisy, weighted)
    numerator = sum(float((s.pow(2).sum(-1) / h.double().pow(2).sum(-1)).sum()) for s, h in zip(shifts, stream.hidden))
    denominator = sum(float((b.target.double().pow(2).sum(-1) / h.double().pow(2).sum(-1)).sum())
                      for b, h in zip(batches, stream.hidden))
    assert error == pytest.approx(numerator / denominator, rel=1e-6)  # float32 weights: 2^-24 each
    plain = relative_output_error(noisy, batches)
    assert plain == pytest.approx(sum(float(s.pow(2).sum()) for s in shifts)
                                  / sum(float(b.target.double().pow(2).sum()) for b in batches), rel=1e-12)
    with pytest.raises(ValueError, match="hidden-state"):
        residual_norm_weights(batches, stream.hidden[:1])


def test_token_weights_travel_with_pieces_and_positions():
    model, layer, stream, batches = _first_layer_batches()
    weighted = residual_norm_weights(batches, stream.hidden)
    pieces = weighted[0].split(3)
    joined = torch.cat([p.token_weights for p in pieces])
    assert joined.dtype == torch.float32
    torch.testing.assert_close(joined, weighted[0].token_weights, rtol=0, atol=0)
    generator = torch.Generator().manual_seed(0)
    ids = [skipped_position_ids(h.shape[0], h.shape[1], 64, generator) for h in stream.hidden]
    moved = at_positions(weighted, ids, functools.partial(attention_kwargs_at, model), layer.self_attn)
    for before, after in zip(weighted, moved):
        assert after.token_weights is before.token_weights


@pytest.mark.parametrize("target", ["residual", "converted"])
def test_the_conversion_trains_on_the_weighted_error(target):
    model = strong_tiny("llama", dtype=torch.float32)
    config = MLAConfig(kv_ratio=0.25, transfer_epochs=20, transfer_batch=2, transfer_target=target,
                       transfer_weighting="residual-norm")
    _, report = convert_to_mla(model, config, CALIBRATION, progress=False)
    uniform = strong_tiny("llama", dtype=torch.float32)
    _, plain = convert_to_mla(uniform, MLAConfig(kv_ratio=0.25, transfer_epochs=20, transfer_batch=2,
                                                 transfer_target=target), CALIBRATION, progress=False)
    for layer, other in zip(report["layers"], plain["layers"]):
        assert layer["transfer"]["kept"] and layer["transfer"]["error_after"] < layer["transfer"]["error_before"]
    # the first layer sees the same inputs and targets in both: only the weights of its tokens differ
    assert report["layers"][0]["transfer"]["error_before"] != plain["layers"][0]["transfer"]["error_before"]
    with pytest.raises(ValueError, match="transfer_weighting"):
        MLAConfig(transfer_weighting="inverse")
