"""adapters.mla_attention.attention_probabilities: the original attention's softmax weights, checked against a
float64 softmax written out from the layer's own projections and rotary tables (causal, sliding window), with
masked entries exactly 0, and the model's attention setting left as it was."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from retrofitter.adapters.mla_attention import attention_probabilities
from retrofitter.adapters.registry import adapter_for
from retrofitter.pipelines.calibration import capture_stream
from retrofitter.pipelines.mla_transfer import attention_batches
from tiny_models import TINY_VOCAB, strong_tiny


def _naive_weights(attention, kwargs, window):
    """softmax(q kᵀ · scaling + mask) [b, h, n, n] from the projections, every kv head read by its query group."""
    hidden = kwargs["hidden_states"]
    b, n, _ = hidden.shape
    dh = attention.head_dim
    q = attention.q_proj(hidden).view(b, n, -1, dh).transpose(1, 2)
    k = attention.k_proj(hidden).view(b, n, -1, dh).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *kwargs["position_embeddings"])
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = q @ k.transpose(-1, -2) * attention.scaling
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = (j <= i) & (j > i - window if window else True)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)


@pytest.mark.parametrize("family, window", [("llama", None), ("qwen2", None), ("mistral", 5)])
def test_attention_probabilities_are_the_written_out_softmax(family, window):
    model = strong_tiny(family, dtype=torch.float64)
    if window:
        model.config.sliding_window = window
    adapter = adapter_for(model)
    ids = torch.randint(3, TINY_VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    stream = capture_stream(model, adapter, ids, 2)
    layer = adapter.decoder_layers(model)[1]
    attention = adapter.attention(layer)
    batch = attention_batches(layer, attention, stream, adapter.cache_kwarg)[0]
    setting = model.config._attn_implementation
    kwargs = dict(batch.kwargs, attention_mask=None)  # no mask: the causal (windowed) one is written out
    weights = attention_probabilities(model, attention, kwargs)
    assert model.config._attn_implementation == setting
    expected = _naive_weights(attention, kwargs, window)
    # HF's eager kernel takes the softmax in float32: scores of order 10 rounded to 2^-24 relative move each
    # weight by about 1e-6 of itself (measured: at most 3e-7)
    torch.testing.assert_close(weights, expected, rtol=1e-5, atol=1e-9)
    # Masked entries exactly 0: the written-out mask adds float64's lowest value, whose exp underflows to exactly 0
    # on every CPU; the reference's masked entries are exp(-inf) = 0. Entries the mask allows stay positive: their
    # scores lie within a few tens of each row's largest, far above float32's smallest normal (exp(-87)).
    masked = expected == 0
    assert float(weights[masked].abs().max()) == 0.0
    assert bool((weights[~masked] > 0).all())
    # the weights mix the values into the attention's own output (as the layer ran it)
    values = attention.v_proj(kwargs["hidden_states"]).view(2, 12, -1, attention.head_dim).transpose(1, 2)
    mixed = weights @ values.repeat_interleave(weights.shape[1] // values.shape[1], 1)
    output = attention.o_proj(mixed.transpose(1, 2).reshape(2, 12, -1))
    if not window:  # the recorded target is the layer's sdpa output under its own (global causal) mask
        scale = float(batch.target.abs().max())  # float32-rounded weights times values of this size
        torch.testing.assert_close(output, batch.target, rtol=0, atol=1e-5 * scale)


def test_an_explicit_mask_is_used_as_given():
    model = strong_tiny("llama", dtype=torch.float64)
    adapter = adapter_for(model)
    ids = torch.randint(3, TINY_VOCAB, (1, 10), generator=torch.Generator().manual_seed(4))
    layer = adapter.decoder_layers(model)[0]
    batch = attention_batches(layer, adapter.attention(layer), capture_stream(model, adapter, ids, 1),
                              adapter.cache_kwarg)[0]
    blocked = torch.zeros(1, 1, 10, 10, dtype=torch.float64)
    blocked[..., 3] = torch.finfo(torch.float64).min  # nobody may read key 3 (query 3 still reads 0 … 2)
    blocked = blocked + torch.full((10, 10), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)
    weights = attention_probabilities(model, adapter.attention(layer), dict(batch.kwargs, attention_mask=blocked))
    assert float(weights[..., 3].abs().max()) == 0.0
    # rows of a float32 softmax: sums within a few 2^-24 of 1
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, weights.shape[1], 10, dtype=torch.float64),
                               rtol=0, atol=1e-6)
