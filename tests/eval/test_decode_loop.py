"""The decode loop: static caches equal dynamic ones, compiled steps equal eager ones, filled caches and the
overhead floor have the right sizes (tiny models; compiled with the tracing-only backend except one test)."""

from __future__ import annotations

import pytest
import torch

from retrofitter.adapters.hybrid_attention import swap_to_hybrid
from retrofitter.adapters.latent_attention import to_latent_attention
from retrofitter.config import LinearizeConfig
from retrofitter.eval.bench import cache_nbytes
from retrofitter.eval.decode_loop import (SkippedProjection, choose_matvec, compile_step, decode_step, fill_cache,
                                          greedy_decode, make_cache, model_kind, prefill, skip_projections)
from retrofitter.adapters import adapter_for
from retrofitter.modules.latent_linear import LatentLinear
from greedy import assert_same_greedy, generated
from tiny_models import TINY_VOCAB, build_tiny, strong_tiny


def low_rank_dense(model, keep=0.5):
    """q/k/v/o as LatentLinear of half rank (plain SVD): a stand-in for a compressed model."""
    adapter = adapter_for(model)
    for layer in adapter.decoder_layers(model):
        for name in ("q", "k", "v", "o"):
            linear = adapter.get_linear(layer, name)
            rank = max(1, int(keep * min(linear.in_features, linear.out_features)))
            adapter.set_linear(layer, name, LatentLinear.from_linear(linear, None, rank, preconditioner="plain"))
    return model


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _model(kind: str):
    if kind == "softmax":
        return strong_tiny("llama")
    if kind == "latent":
        return to_latent_attention(low_rank_dense(strong_tiny("llama", dtype=torch.float64))).float()
    if kind == "mla":  # latent caches too (model_kind "latent")
        from retrofitter.pipelines.mla import MLAConfig, convert_to_mla

        model = strong_tiny("llama")
        calibration = torch.randint(3, TINY_VOCAB, (4, 32), generator=torch.Generator().manual_seed(5))
        return convert_to_mla(model, MLAConfig(kv_ratio=0.5), calibration, progress=False)[0]
    model = strong_tiny("llama")
    swap_to_hybrid(model, LinearizeConfig(window=4).hybrid_settings())
    return model


def _ids(batch=2, length=10):
    return torch.randint(4, TINY_VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


def _eager(model):
    return lambda tokens, position, cache: decode_step(model, tokens, position, cache)


# The loop, generate(), static and dynamic caches, compiled and eager steps are different computations of
# the same float32 logits (other attention shapes over a padded static cache, other kernels), equal up to
# rounding (float32, u ≈ 6e-8, inner dimensions ≤ 48: a few 1e-7 on these logits of magnitude < 0.5, 2e-7
# measured); 1e-5, as for the traced steps below, bounds that with room. Their greedy tokens are equal because
# every step's top-2 margin (≥ 7e-4 here) exceeds twice that bound (tests/greedy.py), not because their
# logits would be bitwise equal.
GREEDY_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def _recording(step, logits: list):
    """``step``, appending the logits of every call to ``logits``."""
    def record(tokens, position, cache):
        logits.append(step(tokens, position, cache))
        return logits[-1]
    return record


def _greedy(step, model, cache, prefilled, start, steps):
    """Every greedy token [b, 1 + steps] (the prefill's first) and the logits [b, 1 + steps, V] it was chosen from."""
    logits = [prefilled]
    tokens, _ = greedy_decode(_recording(step, logits), model, cache, prefilled, start, steps)
    return torch.cat([prefilled.argmax(-1), tokens], dim=1), torch.cat(logits, dim=1)


def _decode(model, cache_kind, step=None, steps=6):
    ids = _ids()
    cache = make_cache(model, cache_kind, max_cache_len=ids.shape[1] + steps + 1)
    logits = prefill(model, ids, cache)
    return _greedy(step or _eager(model), model, cache, logits, ids.shape[1], steps), cache


@pytest.mark.parametrize("kind", ["softmax", "latent", "hybrid", "mla"])
def test_static_cache_decodes_like_generate(kind):
    model = _model(kind)
    assert model_kind(model) == ("latent" if kind == "mla" else kind)
    ids = _ids()
    model.generation_config.eos_token_id = None  # generate() must not stop early: the loop never does
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=7, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    reference, reference_logits = generated(out, ids.shape[1])
    for cache_kind in ("dynamic", "static"):
        (tokens, logits), _ = _decode(model, cache_kind)
        assert_same_greedy(tokens, logits, reference, reference_logits, **GREEDY_TOLERANCE)


def _assert_traced_equals_eager(model, ids, steps: int, **compile_options) -> None:
    """``steps`` decode steps of ``compile_step(model, **compile_options)`` against eager ones on a second static
    cache filled by the same prefill of ``ids``: equal logits to float32 rounding."""
    caches = [make_cache(model, "static", max_cache_len=16) for _ in range(2)]
    logits = [prefill(model, ids, cache) for cache in caches]
    traced = compile_step(model, **compile_options)
    tokens = logits[0].argmax(-1)
    with torch.inference_mode():
        for index in range(steps):
            position = torch.full((1, 1), ids.shape[1] + index)
            eager, compiled = decode_step(model, tokens, position, caches[0]), traced(tokens, position, caches[1])
            torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
            tokens = eager.argmax(-1)


@pytest.mark.parametrize("kind", ["softmax", "latent", "hybrid", "mla"])
def test_traced_step_equals_eager_logits(kind):
    torch._dynamo.reset()
    _assert_traced_equals_eager(_model(kind), _ids(), 4, backend="aot_eager")


@pytest.mark.slow
def test_inductor_step_equals_eager_logits():
    torch._dynamo.reset()
    model = _model("softmax")
    ids = _ids()
    (tokens_eager, logits_eager), _ = _decode(model, "static")
    (tokens_compiled, logits_compiled), _ = _decode(model, "static", step=compile_step(model))
    # inductor fuses kernels: other rounding than eager, equal tokens only through the margins
    assert_same_greedy(tokens_compiled, logits_compiled, tokens_eager, logits_eager, **GREEDY_TOLERANCE)


@pytest.mark.parametrize("kind", ["softmax", "latent", "hybrid"])
def test_filled_cache_has_context_tokens(kind):
    model = _model(kind)
    sizes = {}
    for context in (10, 30):
        cache = make_cache(model, "dynamic")
        logits = fill_cache(model, cache, _ids(), context)
        assert int(cache.get_seq_length()) == context
        sizes[context] = cache_nbytes(cache)
        greedy_decode(_eager(model), model, cache, logits, context, 2)  # decoding continues from there
    if kind == "hybrid":
        assert sizes[30] == sizes[10]  # constant state
    else:
        assert sizes[30] > 2.5 * sizes[10]


def test_static_fill_equals_dynamic_fill():
    model = _model("latent")
    results = []
    for cache_kind in ("dynamic", "static"):
        cache = make_cache(model, cache_kind, max_cache_len=40)
        logits = fill_cache(model, cache, _ids(), 30)
        results.append(_greedy(_eager(model), model, cache, logits, 30, 3))
    (dynamic, dynamic_logits), (static, static_logits) = results
    # the static cache attends over 40 slots (masked), the dynamic one over the filled ones: other shapes
    assert_same_greedy(static, static_logits, dynamic, dynamic_logits, **GREEDY_TOLERANCE)


def test_overhead_floor_skips_projections_and_keeps_tied_embeddings():
    model = build_tiny("gemma2")  # tied embeddings
    floor = skip_projections(model)
    skipped = [m for m in floor.modules() if isinstance(m, SkippedProjection)]
    assert len(skipped) == 2 * 7 + 1
    assert floor.get_input_embeddings().weight is not None
    assert torch.equal(floor.get_input_embeddings().weight, model.get_input_embeddings().weight)  # kept, not recomputed
    assert sum(p.numel() for p in floor.parameters()) < 0.5 * sum(p.numel() for p in model.parameters())
    ids = _ids()
    assert prefill(floor, ids, make_cache(floor, "dynamic")).shape == (2, 1, TINY_VOCAB)
    with pytest.raises(ValueError, match="softmax-attention"):
        skip_projections(_model("hybrid"))


def test_static_cache_refusals():
    with pytest.raises(ValueError, match="max_cache_len"):
        make_cache(_model("softmax"), "static")
    with pytest.raises(ValueError, match="cache kind"):
        make_cache(_model("softmax"), "paged")


def test_the_floor_keeps_what_feeds_it_under_the_compiler():
    # zeros made as a constant, with no use of the input, would make the input's producers dead code (an o_proj
    # ignoring its input lets inductor drop the attention). The floor's zeros are buffers read at run time,
    # times one column of the input: setting them after compiling changes the output, and the output then
    # follows the input, so the input was computed.
    skip = SkippedProjection(8)
    step = torch.compile(lambda x: skip(torch.softmax(x @ x.transpose(-1, -2), -1) @ x), backend="inductor",
                         dynamic=False)
    x = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(step(x), torch.zeros(2, 3, 8))
    with torch.no_grad():
        skip.gain.fill_(1.0)
        skip.source.fill_(0.5)
    expected = (torch.softmax(x @ x.transpose(-1, -2), -1) @ x)[..., :1] + 0.5
    torch.testing.assert_close(step(x), expected.expand(2, 3, 8))


@pytest.mark.parametrize("kind", ["softmax", "mla"])
def test_traced_step_with_reductions_equals_eager_logits(kind):
    """``reduction_rows=b``: the traced step's linear maps are multiplies and sums (no linear call left in the
    graph dynamo hands the backend) and its logits are the eager step's to float32 rounding."""
    torch._dynamo.reset()
    model = _model(kind)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids = _ids()
    _assert_traced_equals_eager(model, ids, 3, backend=backend, fullgraph=True, reduction_rows=ids.shape[0])  # b rows
    targets = {node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    assert graphs and torch._C._nn.linear not in targets and torch.nn.functional.linear not in targets


def test_choose_matvec_measures_both_forms_on_the_models_weights():
    model = _model("softmax")
    choice = choose_matvec(model, rows=1, repeats=2, count=3)
    assert choice["matvec"] in ("blas", "reduction")
    assert choice["blas_ms"] > 0 and choice["reduction_ms"] > 0
    faster = "reduction" if choice["reduction_ms"] < choice["blas_ms"] else "blas"
    assert choice["matvec"] == faster
    floor = skip_projections(model)  # no plain linear weight left to read: nothing to measure
    assert choose_matvec(floor) == {"matvec": "blas", "blas_ms": None, "reduction_ms": None}


def test_traced_step_with_reductions_leaves_quantized_weights_to_their_kernels():
    """int8 weight-only projections (torchao subclasses) keep their own linear; the plain LM head is routed."""
    from retrofitter.modules.quantize import quantize_model

    torch._dynamo.reset()
    model = quantize_model(_model("softmax"), "int8-weight")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids = _ids()
    _assert_traced_equals_eager(model, ids, 2, backend=backend, reduction_rows=ids.shape[0])
    projections = sum(len(adapter_for(model).linear_names) for _ in adapter_for(model).decoder_layers(model))
    for gm in graphs:  # every decoder projection still calls linear; the plain head does not
        linears = [node for node in gm.graph.nodes
                   if node.op == "call_function" and node.target in (torch._C._nn.linear, torch.nn.functional.linear)]
        assert len(linears) == projections
    assert graphs
