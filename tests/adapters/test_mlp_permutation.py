"""Leading MLP pivots: an exact reparametrisation that turns the down projection's gathers into slices."""

import pytest
import torch

from retrofitter.adapters import adapter_for
from retrofitter.adapters.mlp_permutation import lead_mlp_pivots
from retrofitter.config import CompressConfig
from retrofitter.modules.latent_linear import LatentLinear
from retrofitter.pipelines.compress import compress_model

from tiny_models import TINY_VOCAB, strong_tiny


def _factor_mlp(model, rank_fraction=0.6, seed=0):
    """Replace every MLP projection by a random-pivot junction LatentLinear of the same (low-rank) map."""
    adapter = adapter_for(model)
    producers, consumer = adapter.mlp_intermediate()
    generator = torch.Generator().manual_seed(seed)
    for layer in adapter.decoder_layers(model):
        for name in (*producers, consumer):
            linear = adapter.get_linear(layer, name)
            rank = max(1, int(rank_fraction * min(linear.in_features, linear.out_features)))
            B = torch.randn(linear.out_features, rank, generator=generator, dtype=torch.float64) / rank**0.5
            A = torch.randn(rank, linear.in_features, generator=generator, dtype=torch.float64) / linear.in_features**0.5
            bias = linear.bias.detach() if linear.bias is not None else None
            adapter.set_linear(layer, name, LatentLinear.from_factors(B, A, bias=bias, dtype=torch.float64))
    return model


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_leading_pivots_keep_logits_and_switch_to_slices(family):
    model = _factor_mlp(strong_tiny(family, dtype=torch.float64))
    adapter = adapter_for(model)
    _, consumer = adapter.mlp_intermediate()
    downs = [adapter.get_linear(layer, consumer) for layer in adapter.decoder_layers(model)]
    assert not any(d.pivots_lead() for d in downs)  # random pivots do not lead by chance
    tokens = torch.randint(3, TINY_VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(tokens).logits
    assert lead_mlp_pivots(model) == len(downs)
    assert all(d.pivots_lead() for d in downs)
    with torch.no_grad():
        after = model(tokens).logits
    torch.testing.assert_close(after, before, rtol=1e-10, atol=1e-10)
    assert lead_mlp_pivots(model) == 0  # idempotent


def test_slice_path_equals_the_gather_reference():
    module = LatentLinear.from_factors(torch.randn(7, 4, dtype=torch.float64), torch.randn(4, 9, dtype=torch.float64))
    module.pivot_index.copy_(torch.arange(4))
    module.rest_index.copy_(torch.arange(4, 9))
    module.refresh_layout()
    assert module.pivots_lead()
    x = torch.randn(2, 5, 9, dtype=torch.float64)
    torch.testing.assert_close(module.latent(x), module.latent_gathered(x), rtol=1e-12, atol=1e-12)


def test_layout_cache_is_refreshed_by_load_state_dict():
    leading = LatentLinear(9, 7, 4, bias=False, dtype=torch.float64)  # fresh modules have leading pivots
    assert leading.pivots_lead()
    other = LatentLinear.from_factors(torch.randn(7, 4, dtype=torch.float64), torch.randn(4, 9, dtype=torch.float64))
    leading.load_state_dict(other.state_dict())
    assert leading.pivots_lead() == other.pivots_lead()
    x = torch.randn(3, 9, dtype=torch.float64)
    torch.testing.assert_close(leading(x), other(x))


def test_compress_model_leaves_down_projections_with_leading_pivots():
    tokens = torch.randint(3, TINY_VOCAB, (8, 32), generator=torch.Generator().manual_seed(1))
    model, report = compress_model(strong_tiny("llama"), CompressConfig(ratio=0.3, batch_size=4), tokens,
                                   progress=False)
    adapter = adapter_for(model)
    assert report["mlp_layers_with_leading_pivots"] == len(adapter.decoder_layers(model))
    assert all(adapter.get_linear(layer, "down").pivots_lead() for layer in adapter.decoder_layers(model))
