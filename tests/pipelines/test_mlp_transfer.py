"""MLP transfer of the MLA conversion (pipelines/mlp_transfer.py) on tiny models: it lowers the layer's output
error against the original model's stream, trains the MLP alone, puts the weights back when training did not
help, and in the conversion brings the converted model's logits closer to the original's."""

from __future__ import annotations

import pytest
import torch

from retrofitter.adapters.registry import adapter_for
from retrofitter.pipelines.calibration import capture_stream
from retrofitter.pipelines.mla import MLAConfig, convert_to_mla
from retrofitter.pipelines.mla_transfer import relative_output_error
from retrofitter.pipelines.mlp_transfer import layer_batches, transfer_mlp
from tiny_models import TINY_VOCAB, strong_tiny

CALIBRATION = torch.randint(3, TINY_VOCAB, (6, 32), generator=torch.Generator().manual_seed(1))


def _perturbed_first_layer(family):
    """(the first decoder layer of a model whose MLP weights were moved, batches whose targets are the original
    layer's output on the same stream)."""
    original, model = strong_tiny(family, dtype=torch.float32), strong_tiny(family, dtype=torch.float32)
    adapter = adapter_for(model)
    stream = capture_stream(original, adapter, CALIBRATION, 4)
    targets = stream.advance(adapter.decoder_layers(original)[0])
    layer = adapter.decoder_layers(model)[0]
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in adapter.mlp(layer).parameters():
            p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=generator))
    return layer, adapter.mlp(layer), layer_batches(stream, targets)


@pytest.mark.parametrize("family, dtype", [("llama", "float32"), ("qwen2", "float32"), ("llama", "bfloat16")])
def test_mlp_transfer_lowers_the_layers_error_and_trains_the_mlp_alone(family, dtype):
    layer, mlp, batches = _perturbed_first_layer(family)
    before = {name: p.detach().clone() for name, p in layer.named_parameters()}
    mlp_names = {name for name, p in layer.named_parameters() if any(p is q for q in mlp.parameters())}
    record = transfer_mlp(layer, mlp, batches, epochs=30, lr=3e-3, batch_blocks=1, dtype=dtype)
    assert record["steps"] == 30 * 6 and record["kept"]
    assert record["error_after"] < 0.5 * record["error_before"], record
    assert relative_output_error(layer, batches) == pytest.approx(record["error_after"], rel=1e-6)
    assert mlp_names and all(name.startswith("mlp.") for name in mlp_names)
    for name, p in layer.named_parameters():
        assert p.requires_grad and p.grad is None  # flags as they were, no gradients left behind
        if name not in mlp_names:  # untouched by the code: bit for bit
            torch.testing.assert_close(p, before[name], rtol=0, atol=0, msg=name)
        else:  # Adam's first step alone moves every weight with a gradient by about lr = 3e-3
            assert float((p.detach() - before[name]).abs().max()) > 3e-4, name


def test_a_transfer_that_does_not_help_puts_the_weights_back():
    layer, mlp, batches = _perturbed_first_layer("llama")
    before = [p.detach().clone() for p in mlp.parameters()]
    record = transfer_mlp(layer, mlp, batches, epochs=2, lr=1e3, batch_blocks=2)  # steps far too large
    assert not record["kept"] and record["error_after"] == record["error_before"]
    for p, value in zip(mlp.parameters(), before):
        torch.testing.assert_close(p, value, rtol=0, atol=0)


def test_mlp_transfer_settings_are_checked():
    layer, mlp, batches = _perturbed_first_layer("llama")
    with pytest.raises(ValueError, match="epochs >= 1"):
        transfer_mlp(layer, mlp, batches, epochs=0, lr=1e-3, batch_blocks=1)
    with pytest.raises(ValueError, match="dtype"):
        transfer_mlp(layer, mlp, batches, epochs=1, lr=1e-3, batch_blocks=1, dtype="float16")
    with pytest.raises(ValueError, match="submodule"):
        transfer_mlp(layer, torch.nn.Linear(2, 2), batches, epochs=1, lr=1e-3, batch_blocks=1)
    with pytest.raises(ValueError, match="batches"):
        original = strong_tiny("llama", dtype=torch.float32)
        stream = capture_stream(original, adapter_for(original), CALIBRATION, 4)
        layer_batches(stream, capture_stream(original, adapter_for(original), CALIBRATION, 2))
    with pytest.raises(ValueError, match="mlp_transfer_lr"):
        MLAConfig(mlp_transfer_lr=1e-3)  # no transfer epochs
    with pytest.raises(ValueError, match="mlp_transfer_lr"):
        MLAConfig(transfer_epochs=1, mlp_transfer_lr=-1.0)


@pytest.mark.parametrize("target", ["residual", "converted"])
def test_the_conversion_with_mlp_transfer_lands_closer_to_the_original(target):
    original = strong_tiny("llama", dtype=torch.float32)
    with torch.no_grad():
        reference = torch.log_softmax(original(CALIBRATION).logits, -1)

    def convert(mlp_lr):
        model = strong_tiny("llama", dtype=torch.float32)
        config = MLAConfig(kv_ratio=0.25, transfer_epochs=10, transfer_batch=2, transfer_target=target,
                           mlp_transfer_lr=mlp_lr)
        _, report = convert_to_mla(model, config, CALIBRATION, progress=False)
        with torch.no_grad():
            logits = torch.log_softmax(model(CALIBRATION).logits, -1)
        kl = float((reference.exp() * (reference - logits)).sum(-1).mean())  # KL(original ‖ converted) per token
        return model, report, kl

    with_mlp, report, kl = convert(3e-3)
    without, plain, kl_plain = convert(0.0)
    assert all(layer["mlp_transfer"] is None for layer in plain["layers"])
    for layer in report["layers"]:
        record = layer["mlp_transfer"]
        assert record["steps"] == 10 * 3 and record["error_after"] <= record["error_before"]
    assert any(layer["mlp_transfer"]["kept"] for layer in report["layers"])
    assert kl < 0.9 * kl_plain, (kl, kl_plain)
    first = adapter_for(with_mlp).decoder_layers(with_mlp)[0]  # layer 0 sees the same stream and attention inputs
    torch.testing.assert_close(first.self_attn.q_proj.weight,
                               adapter_for(without).decoder_layers(without)[0].self_attn.q_proj.weight, rtol=0, atol=0)
