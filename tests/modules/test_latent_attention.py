"""LatentAttention: full-rank equivalence, latent-cache decoding, generate(), save/load (float64, tiny models)."""

import pytest
import torch

from retrofitter.adapters import adapter_for
from retrofitter.adapters.latent_attention import latent_cache_numbers_per_token, to_latent_attention
from retrofitter.checkpoint import load_retrofitted, save_retrofitted
from retrofitter.adapters.latent_cache import LatentCacheLayer
from retrofitter.modules.latent_attention import LatentAttention
from retrofitter.modules.latent_linear import LatentLinear

from greedy import assert_same_greedy, generated
from tiny_models import strong_tiny as shared_strong_tiny
from tiny_models import TINY_VOCAB, build_tiny


def strong_tiny(family, seed=0):
    """The shared strong tiny model, in float64 (these tests compare to 1e-10)."""
    return shared_strong_tiny(family, seed=seed, dtype=torch.float64)


def ids(n=2, length=12, seed=3):
    return torch.randint(3, TINY_VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def full_rank_latent(model):
    """Every q/k/v/o as a full-rank LatentLinear (exact), then LatentAttention."""
    adapter = adapter_for(model)
    for layer in adapter.decoder_layers(model):
        for name in ("q", "k", "v", "o"):
            linear = adapter.get_linear(layer, name)
            rank = min(linear.in_features, linear.out_features)
            adapter.set_linear(layer, name, LatentLinear.from_linear(linear, None, rank, preconditioner="plain"))
    return to_latent_attention(model)


def low_rank_dense(model, keep=0.5, seed=0):
    """Random low-rank LatentLinear projections (the dense-product model): a stand-in for a compressed model."""
    adapter = adapter_for(model)
    generator = torch.Generator().manual_seed(seed)
    for layer in adapter.decoder_layers(model):
        for name in ("q", "k", "v", "o"):
            linear = adapter.get_linear(layer, name)
            rank = max(1, int(keep * min(linear.in_features, linear.out_features)))
            moment = torch.randn(linear.in_features, linear.in_features, generator=generator, dtype=torch.float64)
            moment = moment @ moment.T / linear.in_features
            mean = torch.zeros(linear.in_features, dtype=torch.float64) if linear.bias is not None else None
            adapter.set_linear(layer, name, LatentLinear.from_linear(linear, moment, rank, mean=mean))
    return model


@pytest.mark.parametrize("family", ["llama", "opt", "qwen3"])
def test_full_rank_conversion_reproduces_logits(family):
    tokens = ids()
    model = strong_tiny(family)
    reference = model(tokens).logits
    converted = full_rank_latent(model)
    assert isinstance(adapter_for(converted).attention(adapter_for(converted).decoder_layers(converted)[0]),
                      LatentAttention)
    torch.testing.assert_close(converted(tokens).logits, reference, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_latent_cache_decode_matches_full_forward(family):
    model = to_latent_attention(low_rank_dense(strong_tiny(family)))
    tokens = ids(2, 14)
    full = model(tokens).logits
    out = model(tokens[:, :9], use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    steps = [out.logits]
    for position in range(9, 14):
        out = model(tokens[:, position:position + 1], cache=cache, use_cache=True)
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-10, rtol=1e-10)
    layer = cache.layers[0]
    assert isinstance(layer, LatentCacheLayer)
    attention = adapter_for(model).attention(adapter_for(model).decoder_layers(model)[0])
    assert layer.keys.shape[-1] + layer.values.shape[-1] == attention.cache_numbers_per_token()
    assert layer.keys.shape[-2] == 14


# Two different computations of one float64 model (the latent attention reassociates the dense one's products
# and caches latents; a padded batch runs other GEMM/attention shapes than a prompt alone): their logits agree
# to float64 rounding, ~1e-15 relative on logits of magnitude < 1, far inside the 1e-10 the other tests of this
# file use. Equal greedy tokens then follow from the reference's top-2 margins (tests/greedy.py; ≥ 4e-3 here),
# not from bitwise-equal logits, which nothing guarantees.
GREEDY_TOLERANCE = dict(rtol=1e-10, atol=1e-10)


def _generate(model, prompt, max_new_tokens, **kwargs):
    out = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, **kwargs)
    return generated(out, prompt.shape[1])


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_generate_latent_cache_equals_dense_product_model(family):
    dense = low_rank_dense(strong_tiny(family))
    prompt = ids(1, 6, seed=7)
    expected, expected_logits = _generate(dense, prompt, 10)
    latent = to_latent_attention(dense)
    produced, produced_logits = _generate(latent, prompt, 10)
    assert_same_greedy(produced, produced_logits, expected, expected_logits, **GREEDY_TOLERANCE)


def test_generate_with_left_padding_matches_unpadded():
    model = to_latent_attention(low_rank_dense(strong_tiny("llama")))
    prompt = ids(1, 6, seed=11)
    alone, alone_logits = _generate(model, prompt, 6)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], dim=1)
    batch = torch.cat([padded, ids(1, 9, seed=12)])
    batch_mask = torch.cat([mask, torch.ones(1, 9, dtype=torch.long)])
    out, out_logits = _generate(model, batch, 6, attention_mask=batch_mask, pad_token_id=0)
    # a [2, 9 + t] batch vs a [1, 6 + t] prompt: other GEMM and attention shapes, equal up to rounding
    assert_same_greedy(out[:1], out_logits[:1], alone, alone_logits, **GREEDY_TOLERANCE)


def test_cache_numbers_per_token_counts_latent_ranks():
    model = to_latent_attention(low_rank_dense(strong_tiny("llama"), keep=0.5))
    adapter = adapter_for(model)
    expected = sum(adapter.get_linear(layer, "k").rank + adapter.get_linear(layer, "v").rank
                   for layer in adapter.decoder_layers(model))
    assert latent_cache_numbers_per_token(model) == expected
    dense_numbers = 2 * 2 * 8 * len(adapter.decoder_layers(model))  # 2·n_kv·d_h per layer
    assert expected < dense_numbers


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_save_load_round_trip(family, tmp_path):
    # float32 end to end: the loader builds float32 modules, so a float32 model must come back bit-identical.
    model = to_latent_attention(low_rank_dense(strong_tiny(family))).float()
    tokens = ids()
    expected = model(tokens).logits
    save_retrofitted(model, tmp_path / "m", {"method": "latentllm"})
    loaded = load_retrofitted(tmp_path / "m")
    assert isinstance(adapter_for(loaded).attention(adapter_for(loaded).decoder_layers(loaded)[1]), LatentAttention)
    # same float32 weights (copied into freshly allocated parameters), same modules, same shapes: bitwise
    assert torch.equal(loaded(tokens).logits, expected)


def test_dense_cache_layer_is_refused():
    from transformers import DynamicCache

    model = to_latent_attention(low_rank_dense(strong_tiny("llama")))
    cache = DynamicCache()
    cache.update(torch.zeros(1, 2, 3, 8, dtype=torch.float64), torch.zeros(1, 2, 3, 8, dtype=torch.float64), 0)
    with pytest.raises(ValueError, match="cannot hold latents"):
        model(ids(1, 2), cache=cache, use_cache=True)


def test_sliding_latent_cache_keeps_the_window_and_its_positions():
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from retrofitter.adapters.latent_cache import LatentSlidingWindowCacheLayer, latent_cache_layer

    class Cache:  # the part of a DynamicCache that latent_cache_layer reads
        layers = [DynamicSlidingWindowLayer(sliding_window=4)]

    cache = Cache()
    slot = latent_cache_layer(cache, 0)
    assert isinstance(slot, LatentSlidingWindowCacheLayer) and cache.layers[0] is slot and slot.sliding_window == 4
    z = torch.arange(2 * 6 * 3, dtype=torch.float32).view(2, 6, 3)
    positions = torch.arange(6, dtype=torch.int32)[None]
    keys, values, seen = slot.update_latent(z, z[..., :2], positions)  # prefill: every token visible
    assert keys.shape == (2, 6, 3) and values.shape == (2, 6, 2) and seen.tolist() == [list(range(6))] * 2
    assert slot.keys.shape[-2] == 3 and slot.positions.tolist() == [[3, 4, 5]] * 2  # window − 1 kept
    keys, _, seen = slot.update_latent(z[:, :1], z[:, :1, :2], torch.tensor([[6]], dtype=torch.int32))
    assert keys.shape[1] == 4 and seen.tolist() == [[3, 4, 5, 6]] * 2 and slot.get_seq_length() == 7
    slot.batch_select_indices(torch.tensor([1]))
    assert slot.keys.shape[0] == 1 and slot.positions.shape == (1, 3)
    slot.reset()
    assert slot.positions is None and slot.get_seq_length() == 0


def test_partial_rotary_rotates_the_first_dims_like_gpt_neox():
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb

    from retrofitter.modules.latent_attention import rotate_half_rope

    x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    angles = torch.randn(2, 5, 2, dtype=torch.float64)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [b, n, 4]: half of dh
    expected, _ = apply_rotary_pos_emb(x, x, cos, sin)
    # the same elementwise products and sums in the same order (each one exactly rounded IEEE operation): bitwise
    torch.testing.assert_close(rotate_half_rope(x, cos, sin), expected, rtol=0, atol=0)
