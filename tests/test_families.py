"""Every supported architecture (one row of tests/tiny_models.py each) through every conversion, fp32.

Per family: compress with each method (latentllm with its latent k/v cache) on random calibration
tokens, save, load, identical logits, generate with the cache (equal to the full forward); the
full-rank conversion reproduces the original logits; linearize (softmax teacher exact, hybrid decode
with the cache = full forward, save/load). Sequences are longer than the tiny sliding windows (Gemma:
6, Phi-3: 8), so sliding layers are exercised in every path.
"""

import pytest
import torch

from retrofitter.adapters import adapter_for, supported_architectures
from retrofitter.adapters.hybrid_attention import HybridCache, hybrid_attention_modules, swap_to_hybrid
from retrofitter.adapters.latent_attention import to_latent_attention
from retrofitter.adapters.latent_cache import LatentSlidingWindowCacheLayer
from retrofitter.checkpoint import load_retrofitted, save_retrofitted
from retrofitter.config import COMPRESS_METHODS, CompressConfig
from retrofitter.modules.latent_attention import LatentAttention
from retrofitter.modules.latent_linear import LatentLinear
from retrofitter.pipelines.compress import compress_model

from tiny_models import FAMILIES, TINY_VOCAB, build_tiny, strong_tiny

METHODS = tuple(COMPRESS_METHODS)  # every method
LINEARIZABLE = [f for f in FAMILIES if type(build_tiny(f)).__name__ in supported_architectures("linearize")]
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def tokens(batch=2, length=14, seed=3):
    return torch.randint(3, TINY_VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def check_generate_with_cache(model, prompt_length=9, new_tokens=5):
    """Greedy generate() with the model's cache; every step's logits equal the full forward's."""
    prompt = tokens(1, prompt_length, seed=11)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        full = model(out.sequences).logits
    assert out.sequences.shape[1] == prompt_length + new_tokens
    stepped = torch.stack(out.logits, dim=1)  # [1, new, vocab]
    torch.testing.assert_close(stepped, full[:, prompt_length - 1:-1], **TOLERANCE)
    return out


def check_save_load(model, tmp_path, metadata):
    ids = tokens()
    expected = logits(model, ids)
    save_retrofitted(model, tmp_path / "m", metadata)
    loaded = load_retrofitted(tmp_path / "m")
    # same float32 weights (copied into freshly allocated parameters), same modules, same shapes: bitwise
    torch.testing.assert_close(logits(loaded, ids), expected, rtol=0, atol=0)
    return loaded


@pytest.mark.parametrize("family", FAMILIES)
def test_full_rank_conversion_reproduces_the_original_logits(family):
    model = strong_tiny(family)
    ids = tokens()
    reference = logits(model, ids)
    adapter = adapter_for(model)
    for layer in adapter.decoder_layers(model):
        for name in adapter.linear_names:
            linear = adapter.get_linear(layer, name)
            rank = min(linear.in_features, linear.out_features)
            adapter.set_linear(layer, name, LatentLinear.from_linear(linear, None, rank, preconditioner="plain"))
    torch.testing.assert_close(logits(model, ids), reference, **TOLERANCE)
    if adapter.latent_attention:
        to_latent_attention(model)
        assert all(isinstance(adapter.attention(layer), LatentAttention) for layer in adapter.decoder_layers(model))
        torch.testing.assert_close(logits(model, ids), reference, **TOLERANCE)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("family", FAMILIES)
def test_compress_save_load_generate(family, method, tmp_path):
    model = strong_tiny(family)
    calibration = tokens(8, 32, seed=1)
    config = CompressConfig(method=method, ratio=0.3, batch_size=4)
    model, report = compress_model(model, config, calibration, progress=False)
    adapter = adapter_for(model)
    for layer in adapter.decoder_layers(model):
        assert all(isinstance(adapter.get_linear(layer, name), LatentLinear) for name in adapter.linear_names)
    latent = method == "latentllm" and adapter.latent_attention
    assert isinstance(adapter.attention(adapter.decoder_layers(model)[0]), LatentAttention) == latent
    if latent:
        assert report["cache_numbers_per_token"] > 0
    assert torch.isfinite(logits(model, calibration[:2])).all()
    loaded = check_save_load(model, tmp_path, {"method": method})
    out = check_generate_with_cache(loaded)
    if latent and any(adapter.sliding_window(adapter.attention(layer)) for layer in adapter.decoder_layers(loaded)):
        slots = [slot for slot in out.past_key_values.layers if isinstance(slot, LatentSlidingWindowCacheLayer)]
        assert slots and all(slot.keys.shape[-2] < slot.sliding_window for slot in slots)  # the window is kept


@pytest.mark.parametrize("family", LINEARIZABLE)
def test_linearize_teacher_reproduces_the_original_logits(family):
    """Every layer swapped (sliding and global ones), softmax mode: the original model's logits."""
    model = strong_tiny(family)
    ids = tokens(2, 16)
    reference = logits(model, ids)
    assert swap_to_hybrid(model, {"window": 4, "feature_dim": 6}) == [0, 1]
    for module in hybrid_attention_modules(model).values():
        module.mode = "softmax"
    torch.testing.assert_close(logits(model, ids), reference, **TOLERANCE)


@pytest.mark.parametrize("family", LINEARIZABLE)
def test_linearized_model_decodes_with_its_cache_and_round_trips(family, tmp_path):
    """Layer 1 hybrid, layer 0 kept softmax (Gemma / Phi-3: a sliding layer that keeps its window)."""
    model = strong_tiny(family)
    ids = tokens(2, 16)
    assert swap_to_hybrid(model, {"window": 4, "feature_dim": 6}, keep_softmax_layers=(0,)) == [1]
    with torch.no_grad():  # move off the identity-like init so the hybrid is not a special case
        generator = torch.Generator().manual_seed(5)
        for module in hybrid_attention_modules(model).values():
            for p in module.hybrid.trainable_parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    full = logits(model, ids)
    with torch.no_grad():
        cache = HybridCache(model)
        out = model(input_ids=ids[:, :9], cache=cache, use_cache=True)
        steps = [out.logits]
        for t in range(9, ids.shape[1]):
            steps.append(model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOLERANCE)
    adapter = adapter_for(model)
    window = adapter.sliding_window(adapter.attention(adapter.decoder_layers(model)[0]))
    if window:
        assert cache.layers[0].keys.shape[-2] < window  # the kept sliding layer keeps its window
    loaded = check_save_load(model, tmp_path, {"method": "linearize"})
    check_generate_with_cache(loaded)
