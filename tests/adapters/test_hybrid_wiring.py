"""HF wiring of the hybrid attention: exactness vs softmax, decode == full forward, generate(), cache size."""

import pytest
import torch

from retrofitter.adapters.hybrid_attention import (HybridCache, HybridSelfAttention, hybrid_attention_modules,
                                                    swap_to_hybrid)
from retrofitter.adapters.hybrid_cache import HybridCacheLayer
from retrofitter.eval.accounting import account
from retrofitter.eval.bench import cache_nbytes
from retrofitter.ops.hybrid_common import WINDOW_KINDS, WindowKind
from greedy import assert_same_greedy, generated
from tiny_models import TINY_VOCAB, build_tiny

F64 = torch.float64
SETTINGS = dict(window=4, feature_dim=6)


def hybrid_model(family="llama", window_kind="terraced", keep=(), seed=0, **overrides):
    model = build_tiny(family, seed=seed, dtype=F64)
    swap_to_hybrid(model, {**SETTINGS, "window_kind": window_kind, **overrides}, keep_softmax_layers=keep)
    with torch.no_grad():  # move off the identity-like init so the checks are not a special case
        generator = torch.Generator().manual_seed(seed + 1)
        for module in hybrid_attention_modules(model).values():
            for p in module.hybrid.trainable_parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return model


def ids(batch=2, length=19, seed=0):
    return torch.randint(3, TINY_VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def decode_logits(model, tokens, prefill, cache):
    out = model(input_ids=tokens[:, :prefill], cache=cache, use_cache=True)
    logits = [out.logits]
    for t in range(prefill, tokens.shape[1]):
        out = model(input_ids=tokens[:, t:t + 1], cache=cache, use_cache=True)
        logits.append(out.logits)
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("window_kind", ["sliding", "terraced"])
def test_token_by_token_decode_matches_full_forward(family, window_kind):
    model = hybrid_model(family, window_kind)
    tokens = ids()
    with torch.no_grad():
        full = model(input_ids=tokens, use_cache=False).logits
        stepped = decode_logits(model, tokens, prefill=6, cache=HybridCache(model))
    assert torch.allclose(stepped, full, atol=1e-10, rtol=0)


def test_default_dynamic_cache_is_adopted_and_kept_softmax_layers_still_cache_keys():
    from transformers import DynamicCache

    model = hybrid_model("llama", keep=(0,))
    assert not isinstance(model.model.layers[0].self_attn, HybridSelfAttention)
    tokens = ids()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        full = model(input_ids=tokens, use_cache=False).logits
        stepped = decode_logits(model, tokens, prefill=5, cache=cache)
    assert torch.allclose(stepped, full, atol=1e-10, rtol=0)
    assert isinstance(cache.layers[1], HybridCacheLayer) and not isinstance(cache.layers[0], HybridCacheLayer)
    assert cache.get_seq_length() == tokens.shape[1]


def test_softmax_only_mix_with_window_covering_the_sequence_reproduces_the_original():
    """First invariant: no linear history (window >= n) and gamma = 1 -> exactly softmax attention."""
    original = build_tiny("llama", dtype=F64)
    model = build_tiny("llama", dtype=F64)
    swap_to_hybrid(model, dict(window=32, window_kind="sliding", feature_dim=6, linear_weight="one_minus_gamma",
                               mix_init=50.0))
    tokens = ids(length=24)
    with torch.no_grad():
        expected = original(input_ids=tokens).logits
        assert torch.allclose(model(input_ids=tokens).logits, expected, atol=1e-10, rtol=0)  # through a cache
        for module in hybrid_attention_modules(model).values():  # the teacher path too
            module.mode = "softmax"
        assert torch.allclose(model(input_ids=tokens, use_cache=False).logits, expected, atol=1e-10, rtol=0)


def test_left_padded_batch_generates_what_each_prompt_generates_alone():
    model = hybrid_model("llama", "terraced")
    prompts = [ids(1, 11, seed=3)[0], ids(1, 6, seed=4)[0]]
    width = max(len(p) for p in prompts)
    batch = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        batch[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    greedy = dict(max_new_tokens=9, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        together, together_logits = generated(model.generate(input_ids=batch, attention_mask=mask, **greedy), width)
        for row, prompt in enumerate(prompts):
            alone, alone_logits = generated(model.generate(input_ids=prompt[None], **greedy), len(prompt))
            # a padded [2, 11] batch vs one prompt: other shapes, so logits equal to float64 rounding only (~1e-16
            # relative; 1e-10 as in the decode tests above); equal tokens follow from the margins (tests/greedy.py)
            assert_same_greedy(together[row:row + 1], together_logits[row:row + 1], alone, alone_logits,
                               rtol=1e-10, atol=1e-10)


def test_sampling_generate_with_padding_and_an_explicit_hybrid_cache():
    model = hybrid_model("qwen3", "sliding")
    batch = ids(2, 8)
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    outputs = []
    for _ in range(2):
        torch.manual_seed(7)
        with torch.no_grad():
            outputs.append(model.generate(input_ids=batch, attention_mask=mask, max_new_tokens=6, do_sample=True,
                                          top_k=20, temperature=0.9, pad_token_id=0, cache=HybridCache(model)))
    assert outputs[0].shape == (2, 14)
    # seeded sampling is reproducible: the same computation twice (same kernels, shapes, random stream): bitwise
    assert torch.equal(outputs[0], outputs[1])
    assert int(outputs[0].max()) < TINY_VOCAB


def test_decode_state_size_does_not_depend_on_context_length():
    model = hybrid_model("llama", "terraced")
    sizes = []
    for length in (5, 40):
        cache = HybridCache(model)
        with torch.no_grad():
            decode_logits(model, ids(2, length + 3), prefill=length, cache=cache)
        sizes.append(cache.state_nbytes())
    assert sizes[0] == sizes[1] > 0
    layer = model.model.layers[0].self_attn
    assert layer.cache_numbers_per_token() == 0
    assert account(model).kv_bytes_per_token == 0
    # state_numbers() describes exactly what the cache holds (bookkeeping tensors aside)
    state = cache.layers[0].state
    held = sum(t.numel() for t in (state.keys, state.values, state.kv_state, state.k_state))
    assert layer.state_numbers(batch_size=2) == held


def test_bad_requests_fail_clearly():
    with pytest.raises(ValueError, match="out of range"):
        swap_to_hybrid(build_tiny("llama"), SETTINGS, keep_softmax_layers=(5,))
    with pytest.raises(ValueError, match="family"):
        swap_to_hybrid(build_tiny("opt"), SETTINGS)
    model = hybrid_model("llama")
    with pytest.raises(ValueError, match="already hybrid"):
        swap_to_hybrid(model, SETTINGS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_bytes_are_the_bytes_of_the_cache_tensors(dtype):
    """S, z stay float32 in a bf16 model: state_bytes and the accounting use the real dtypes."""
    model = build_tiny("llama", dtype=dtype)
    swap_to_hybrid(model, {**SETTINGS, "window_kind": "terraced"}, keep_softmax_layers=(0,))
    acc = account(model)
    layer = model.model.layers[1].self_attn
    for batch, length in ((1, 7), (2, 13)):
        cache = HybridCache(model)
        with torch.no_grad():
            model(input_ids=ids(batch, length), cache=cache, use_cache=True)
        assert layer.state_bytes(batch_size=batch) == cache.layers[1].nbytes() == cache.state_nbytes()
        if batch == 1:  # the whole cache: constant state + the kept softmax layer's keys/values
            assert cache_nbytes(cache) == acc.state_bytes_per_sequence + length * acc.kv_bytes_per_token
    assert cache.layers[1].state.kv_state.dtype == torch.float32
    assert acc.state_bytes_per_sequence == layer.state_bytes(1)


def test_state_counts_follow_the_window_kind_registry(monkeypatch):
    """A new window kind (here: a sliding window kept in a ring of 2w) needs no change to the counts."""
    sliding = WINDOW_KINDS["sliding"]
    wide = WindowKind("wide_sliding", sliding.contains, buffer_factor=2,
                      eviction_slots=lambda new_pos, window: torch.remainder(new_pos - window, 2 * window)[:, None],
                      leave_position=sliding.leave_position, leave_lag=sliding.leave_lag)
    monkeypatch.setitem(WINDOW_KINDS, "wide_sliding", wide)
    model = hybrid_model("llama", "wide_sliding")
    tokens = ids(1, 15)
    cache = HybridCache(model)
    with torch.no_grad():
        full = model(input_ids=tokens, use_cache=False).logits
        stepped = decode_logits(model, tokens, prefill=6, cache=cache)
    assert torch.allclose(stepped, full, atol=1e-10, rtol=0)
    layer = model.model.layers[0].self_attn
    state = cache.layers[0].state
    assert state.keys.shape[2] == 2 * SETTINGS["window"]
    assert layer.state_numbers() == sum(t.numel() for t in (state.keys, state.values, state.kv_state, state.k_state))
    assert layer.state_bytes() == state.nbytes()


@pytest.mark.parametrize("window_kind", ["sliding", "terraced"])
def test_sinks_and_sparse_cache_decode_matches_full_forward_and_survive_save_load(window_kind, tmp_path):
    from retrofitter.adapters.hybrid_attention import set_recall
    from retrofitter.api import save
    from retrofitter.checkpoint import load_retrofitted

    model = hybrid_model("llama", window_kind)
    tokens = ids(length=30)
    with torch.no_grad():
        plain = model(input_ids=tokens, use_cache=False).logits
        assert set_recall(model, sinks=2, sparse_cache=3) == [0, 1]
        full = model(input_ids=tokens, use_cache=False).logits
        assert (full - plain).abs().max() > 1e-6  # the recall terms are in effect
        cache = HybridCache(model)
        stepped = decode_logits(model, tokens, prefill=9, cache=cache)
    assert torch.allclose(stepped, full, atol=1e-10, rtol=0)
    state = cache.layers[0].state
    assert state.sinks == 2 and state.sparse_cache == 3 and (state.sparse_positions >= 0).all()
    layer = model.model.layers[0].self_attn
    assert layer.state_bytes(2) == sum(l.nbytes() for l in cache.layers[:1])
    numbers = sum(t.numel() for name, t in state.tensors().items()
                  if name not in ("positions", "valid", "num_tokens", "sparse_positions"))
    assert layer.state_numbers(2) == numbers
    save(model, tmp_path / "out", metadata={"method": "lolcats"})
    loaded = load_retrofitted(tmp_path / "out", dtype=F64)
    assert loaded.model.layers[1].self_attn.hybrid.recall == layer.hybrid.recall
    with torch.no_grad():  # the checkpoint keeps float32 weights: float32 rounding of a float64 model
        assert torch.allclose(loaded(input_ids=tokens).logits, full, atol=1e-6, rtol=0)


def test_set_recall_needs_a_linearized_model():
    from retrofitter.adapters.hybrid_attention import set_recall

    with pytest.raises(ValueError, match="linearized model"):
        set_recall(build_tiny("llama"), sinks=4, sparse_cache=0)


def test_layers_without_linear_part_keep_no_linear_state_and_decode_as_the_full_forward():
    """swa-sinks(-cache): linear_weight "zero" keeps no S, z; the step skips their work and still equals the forward
    (HF passes an all-real mask in every decode step: the step's unmasked path runs)."""
    model = hybrid_model("llama", "sliding", linear_weight="zero", sinks=2, sparse_cache=3)
    tokens = ids(length=30)
    with torch.no_grad():
        full = model(input_ids=tokens, use_cache=False).logits
        cache = HybridCache(model)
        stepped = decode_logits(model, tokens, prefill=9, cache=cache)
    assert torch.allclose(stepped, full, atol=1e-10, rtol=0)
    state = cache.layers[0].state
    assert state.kv_state.shape[2] == 0 and state.k_state.shape[2] == 0 and state.score_kv.shape[2] > 0
    layer = model.model.layers[0].self_attn
    assert layer.state_bytes(2) == cache.layers[0].nbytes()
    numbers = sum(t.numel() for name, t in state.tensors().items()
                  if name not in ("positions", "valid", "num_tokens", "sparse_positions"))
    assert layer.state_numbers(2) == numbers
