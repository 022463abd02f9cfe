"""The kernels MLA's absorbed execution hands its attention to: flex attention takes the narrow value c [r]; the
accounting counts the widths the kernel receives; a CPU decode step under sdpa splits its cache across threads
(ops/decode_attention.py). Each equals the naive reference."""

from __future__ import annotations

import pytest
import torch

from retrofitter.eval.accounting import account
from retrofitter.eval.decode_loop import compile_step, decode_step, make_cache, prefill
from retrofitter.modules import mla_attention as mla_module
from mla_helpers import converted_mla, full_and_stepwise, set_execution
from tiny_models import TINY_VOCAB

# HF's flex attention compiles its mask and kernel with inductor, whose CPU code does not build without a vector ISA
# (ATEN_CPU_CAPABILITY=default, as `make test-kernel-path` sets; PyTorch 2.13: a C++ error in the mask kernel)
needs_vector_inductor = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT",
                                           reason="inductor's CPU flex attention needs a vector ISA")


@needs_vector_inductor
@pytest.mark.parametrize("fold", [False, True], ids=["up-projections", "folded"])
def test_absorbed_under_flex_attention_reads_the_narrow_value_and_equals_naive(fold, monkeypatch):
    """flex_attention takes the value c [r] (narrower than the key): a left-padded prefill and decoding through the
    cache equal the naive reference (run under eager masks: it takes no BlockMask). Float32 (inductor's CPU flex
    kernel); the decoding unpadded: inductor does not compile a left-padded flex decode step on CPU (PyTorch 2.13,
    a C++ error), for the original model as well."""
    model = converted_mla("llama", kv_ratio=0.25, dtype=torch.float32, fold=fold)
    widths = []
    original_resolver = model.model.layers[0].self_attn._attention_resolver

    def recording_resolver():
        kernel = original_resolver()
        return lambda module, query, key, value, *args, **kwargs: (
            widths.append((key.shape[-1], value.shape[-1])) or kernel(module, query, key, value, *args, **kwargs))

    monkeypatch.setattr(model.model.layers[0].self_attn, "_attention_resolver", recording_resolver)
    ids = torch.randint(3, TINY_VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    model.config._attn_implementation = "eager"
    set_execution(model, "naive")
    expected, _ = full_and_stepwise(model, ids, mask)
    model.config._attn_implementation = "flex_attention"
    set_execution(model, "absorbed")
    full, stepwise = full_and_stepwise(model, ids, mask)
    attention = model.model.layers[0].self_attn
    # two float32 executions of ~100-term sums, logits of order 10
    torch.testing.assert_close(full, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(stepwise, expected, rtol=1e-4, atol=1e-4)
    mask[1, :4] = 0  # left padding, prefill only
    valid = mask.bool()
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask).logits
        model.config._attn_implementation = "eager"
        set_execution(model, "naive")
        padded_expected = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(padded[valid], padded_expected[valid], rtol=1e-4, atol=1e-4)
    assert widths and set(widths) == {(attention.kv_rank + attention.rope_dim, attention.kv_rank)}


@pytest.mark.parametrize("narrow", [False, True], ids=["key-as-value", "narrow-value"])
def test_attention_macs_count_what_the_absorbed_kernel_computes(narrow, monkeypatch):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from retrofitter.adapters import mla_attention as mla_adapter

    seen = []

    def recording_sdpa(module, query, key, value, mask, **kwargs):  # the shapes every kernel call receives
        seen.append((query.shape, key.shape, value.shape))
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    name = "retrofitter_test_recording_sdpa"
    AttentionInterface.register(name, recording_sdpa)
    if narrow:  # the recording kernel as one that takes a value narrower than the key
        monkeypatch.setattr(mla_adapter, "NARROW_VALUE_IMPLEMENTATIONS", (name,))
    model = converted_mla("llama", kv_ratio=0.25, dtype=torch.float32)
    model.set_attn_implementation(name)
    n = 16
    ids = torch.randint(3, TINY_VOCAB, (1, n), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model(ids, use_cache=False)
    # q·k over the key width and p·v over the value width, every query against every key:
    # [b, h, n, ·] x [b, 1, N, ·]
    full = sum(q[0] * q[1] * q[2] * k[2] * (q[3] + v[3]) for q, k, v in seen)
    assert len(seen) == len(model.model.layers)
    attention = model.model.layers[0].self_attn
    value_width = attention.kv_rank if narrow else attention.kv_rank + attention.rope_dim
    assert {v[3] for _, _, v in seen} == {value_width}
    assert full == len(model.model.layers) * attention.n_heads * (
        attention.kv_rank + attention.rope_dim + value_width) * n * n
    # the accounting's causal average: n/2 keys per query
    assert account(model, context=n).attention_macs_per_token * n * 2 == full


@pytest.mark.parametrize("fold", [False, True], ids=["up-projections", "folded"])
def test_decode_step_split_across_threads_equals_naive(fold, monkeypatch):
    """Decoding under sdpa on CPU with the cache split into stretches (forced here from 2 × 4 keys and 3 threads; a
    real step splits from 2 × MIN_SPLIT_KEYS) equals the naive reference in float64, left padding included (whole
    stretches masked in the padded row) and cache lengths that are no multiple of the stretches."""
    model = converted_mla("llama", kv_ratio=0.25, dtype=torch.float64, fold=fold).eval()
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(3, TINY_VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    valid = mask.bool()
    set_execution(model, "naive")
    expected, _ = full_and_stepwise(model, ids, mask)
    splits = []
    kernel = mla_module.split_kv_decode_attention
    monkeypatch.setattr(mla_module, "split_kv_decode_attention", lambda *args: splits.append(args[-1]) or kernel(*args))
    monkeypatch.setattr(mla_module, "MIN_SPLIT_KEYS", 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    set_execution(model, "absorbed")
    full, stepwise = full_and_stepwise(model, ids, mask)
    layers = len(model.model.layers)
    # 8–11 cached keys: 2 stretches, 12–16: 3 (min(threads, N // MIN_SPLIT_KEYS)); fewer: the resolved kernel
    assert splits == [2] * 4 * layers + [3] * 5 * layers
    # float64 rounding of logits of order 10
    torch.testing.assert_close(stepwise[valid], expected[valid], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(full[valid], expected[valid], rtol=1e-10, atol=1e-10)
    model.config._attn_implementation = "eager"  # any other kernel: the step is not split
    splits.clear()
    full_and_stepwise(model, ids, mask)
    assert splits == []
    model.config._attn_implementation = "sdpa"  # nor with the split switched off
    for layer in model.model.layers:
        layer.self_attn.split_cpu_decode = False
    full_and_stepwise(model, ids, mask)
    assert splits == []


def test_split_decode_step_compiles_to_one_graph(monkeypatch):
    """torch.compile traces a split CPU decode step whole (``fullgraph``: a graph break raises): the thread count that
    picks the stretches is read as a trace-time constant, where a plain ``torch.get_num_threads()`` broke the graph in
    every layer. Eager and traced steps both split the cache, and they give the same logits."""
    torch._dynamo.reset()
    model = converted_mla("llama", kv_ratio=0.25, dtype=torch.float32, fold=True).eval()
    model.config._attn_implementation = "sdpa"
    monkeypatch.setattr(mla_module, "MIN_SPLIT_KEYS", 4)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the real call (a patched Python function would trace as a constant and hide the break)
    splits = []
    kernel = mla_module.split_kv_decode_attention
    monkeypatch.setattr(mla_module, "split_kv_decode_attention", lambda *args: splits.append(args[-1]) or kernel(*args))
    ids = torch.randint(3, TINY_VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    caches = [make_cache(model, "static", max_cache_len=20) for _ in range(2)]
    tokens = prefill(model, ids, caches[0]).argmax(-1)
    prefill(model, ids, caches[1])
    traced = compile_step(model, backend="eager", fullgraph=True)
    traced_splits = []
    try:
        with torch.inference_mode():
            for index in range(3):
                position = torch.full((1, 1), ids.shape[1] + index)
                eager = decode_step(model, tokens, position, caches[0])
                before = len(splits)
                compiled = traced(tokens, position, caches[1])
                traced_splits += splits[before:]  # the traced step's own calls of the split kernel
                # the same kernels on the same inputs: float32 rounding of logits of order 10
                torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
                tokens = eager.argmax(-1)
    finally:
        torch.set_num_threads(threads)
    assert splits and set(splits) == {2}  # the static cache's 20 slots: 2 stretches in every layer, eager and traced
    assert traced_splits and set(traced_splits) == {2}  # the traced graph itself runs the split
