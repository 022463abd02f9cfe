"""Greedy decoding as a loop of single-token forwards, eager or ``torch.compile``d, on any model kind.

``generate()`` adds per-step Python work (logits processors, stopping criteria, streamer, cache
bookkeeping) that on a small model costs as much as the model; this loop keeps only the forward:

    logits = model(input_ids=t [b, 1], position_ids=p [1, 1], cache=cache, logits_to_keep=1)   [b, 1, V]
    t ← argmax(logits)                                                                            [b, 1]

Caches (``make_cache``): ``"dynamic"`` is the model's own growing cache (HF ``DynamicCache``; latent
and hybrid layers adopt their slots; ``HybridCache`` for a hybrid model); ``"static"`` is preallocated
for ``max_cache_len`` tokens and written in place, so that every step has the same shapes and one
``torch.compile`` trace serves all of them: HF ``StaticCache`` for softmax attention (original model,
``LatentLinear`` projections), ``StaticLatentCache`` for ``LatentAttention`` (latents + positions),
``StaticHybridCache`` for an all-hybrid model (constant state updated in place).

``fill_cache`` grows a cache to a long context without a long prefill (the decode cost of a step
depends on the shapes of the cache, not on its contents): a short real prefill, then the cached
entries repeated cyclically up to ``context`` tokens (positions ``0..context−1``); a hybrid layer's
state is shifted to ``context`` tokens seen (its size does not change).

``skip_projections(model)`` is the overhead floor: a copy whose decoder projections and LM head return
zeros of the right shape without reading a weight, so what remains is embeddings, norms, RoPE, the
attention core, cache updates and the framework's per-op cost.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer

from ..adapters import adapter_for
from ..adapters.hybrid_attention import HybridCache, hybrid_attention_modules
from ..adapters.hybrid_cache import HybridCacheLayer, StaticHybridCache, StaticHybridCacheLayer
from ..adapters.latent_cache import LatentCacheLayer, StaticLatentCache, StaticLatentCacheLayer
from ..modules.latent_attention import LatentAttention
from ..modules.latent_linear import LatentLinear
from ..modules.mla_attention import MLAAttention
from ..ops.matvec import ReductionMatvec, matvec_reduction, plain_float_linear

__all__ = ["CACHE_KINDS", "MATVEC_CHOICES", "SkippedProjection", "choose_matvec", "compile_step", "prepare_for_compile",
           "decode_step", "fill_cache", "greedy_decode",
           "make_cache", "model_kind", "prefill", "skip_projections"]

CACHE_KINDS = ("dynamic", "static")
# how a compiled decode step runs its linear maps: measured per machine and dtype (auto), BLAS calls, or reductions
MATVEC_CHOICES = ("auto", "blas", "reduction")


def model_kind(model: nn.Module) -> str:
    """``"latent"`` (LatentAttention or MLAAttention layers: latent caches), ``"hybrid"`` (hybrid attention
    layers) or ``"softmax"``."""
    if any(isinstance(m, (LatentAttention, MLAAttention)) for m in model.modules()):
        return "latent"
    if hybrid_attention_modules(model):
        return "hybrid"
    return "softmax"


def make_cache(model: nn.Module, kind: str = "dynamic", max_cache_len: int | None = None):
    """An empty cache of ``kind`` (``CACHE_KINDS``) for ``model``; ``max_cache_len`` for static caches."""
    if kind not in CACHE_KINDS:
        raise ValueError(f"cache kind must be one of {CACHE_KINDS}; got {kind!r}")
    family = model_kind(model)
    if kind == "dynamic":
        return HybridCache(model) if family == "hybrid" else DynamicCache(config=model.config)
    if max_cache_len is None or max_cache_len < 1:
        raise ValueError(f"a static cache needs max_cache_len >= 1; got {max_cache_len}")
    adapter = adapter_for(model)
    layers = adapter.decoder_layers(model)
    if family == "latent":
        if any(adapter.sliding_window(adapter.attention(layer)) for layer in layers):
            raise ValueError("a static latent cache needs global attention in every layer (this model has "
                             "sliding-window layers); use the dynamic cache")
        return StaticLatentCache(len(layers), max_cache_len)
    if family == "hybrid":
        if len(hybrid_attention_modules(model)) != len(layers):
            raise ValueError("a static hybrid cache needs every layer hybrid (this model keeps softmax layers); "
                             "use the dynamic cache")
        return StaticHybridCache(len(layers))
    return StaticCache(config=model.config, max_cache_len=max_cache_len)


@torch.inference_mode()
def prefill(model: nn.Module, ids: torch.Tensor, cache) -> torch.Tensor:
    """Run ``ids [b, n]`` into ``cache``; the last position's logits ``[b, 1, V]``."""
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    return model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1).logits


def decode_step(model: nn.Module, tokens: torch.Tensor, position: torch.Tensor, cache) -> torch.Tensor:
    """One step: ``tokens [b, 1]`` at ``position [1, 1]`` (a tensor: no recompilation) -> logits ``[b, 1, V]``."""
    return model(input_ids=tokens, position_ids=position, cache=cache, use_cache=True, logits_to_keep=1).logits


def prepare_for_compile(model: nn.Module) -> nn.Module:
    """Settle what modules compute lazily on first call (``LatentLinear.pivots_lead``: a host-side check
    that would break the traced graph); returns ``model``."""
    for module in model.modules():
        if isinstance(module, LatentLinear):
            module.pivots_lead()
    return model


def compile_step(model: nn.Module, backend: str = "inductor", fullgraph: bool = False,
                 reduction_rows: int = 0) -> Callable:
    """``decode_step`` bound to ``model`` under ``torch.compile`` (static shapes; ``backend`` "inductor"
    generates fused kernels, "aot_eager" only traces: the quick check that tracing keeps the results).
    ``fullgraph``: a graph break is an error instead of a split into several compiled regions (tests use it:
    a break per layer costs a guard check and a region call each, and the fusion across it).
    ``reduction_rows`` > 0: every linear map of at most that many input rows (a decode step at batch b has b)
    is traced as a multiply and a sum (``ops.matvec``), which inductor fuses into one reduction per weight;
    ``choose_matvec`` measures whether that is faster than the BLAS call on this machine and dtype."""
    prepare_for_compile(model)
    rows = int(reduction_rows)

    def step(tokens, position, cache):
        if rows < 1:
            return decode_step(model, tokens, position, cache)
        with ReductionMatvec(rows):
            return decode_step(model, tokens, position, cache)

    return torch.compile(step, dynamic=False, backend=backend, fullgraph=fullgraph)


def _sampled_linears(model: nn.Module, count: int) -> list[torch.Tensor]:
    """The output head's weight and up to ``count`` decoder projections' from the middle of the model: plain
    float ``nn.Linear`` weights, the ones a decode step reads."""
    linears = [m.weight for m in model.modules() if plain_float_linear(m)]
    head = model.get_output_embeddings()
    head = [head.weight] if head is not None and any(w is head.weight for w in linears) else []
    rest = [w for w in linears if not any(w is h for h in head)]
    start = max(0, len(rest) // 2 - count // 2)
    return head + rest[start:start + count]


@torch.inference_mode()
def choose_matvec(model: nn.Module, rows: int = 1, repeats: int = 7, count: int = 7) -> dict:
    """Whether a compiled decode step of ``rows`` rows should run its linear maps as BLAS calls or as fused
    reductions (``compile_step(reduction_rows=)``), measured on this machine: the output head and ``count``
    decoder weights of ``model`` itself, each applied to random ``[rows, d]`` inputs, ``F.linear`` against the
    compiled reduction, interleaved, ``repeats`` times after a warm-up. Returns ``{"matvec": "blas" |
    "reduction", "blas_ms", "reduction_ms"}`` (medians of one pass over the sampled weights); off a CPU, or
    with no plain float weights, "blas" without a measurement."""
    weights = _sampled_linears(model, count)
    if not weights or weights[0].device.type != "cpu":
        return {"matvec": "blas", "blas_ms": None, "reduction_ms": None}
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(rows, w.shape[1], generator=generator).to(w.dtype) for w in weights]

    def blas(xs, ws):
        return [F.linear(x, w) for x, w in zip(xs, ws)]

    def reduction(xs, ws):
        return [matvec_reduction(x, w) for x, w in zip(xs, ws)]

    candidates = {"blas": blas, "reduction": torch.compile(reduction, dynamic=False)}
    times: dict[str, list[float]] = {name: [] for name in candidates}
    # every call traces ``reduction`` (one code object) anew for its shapes: past dynamo's default limit of 8 traces
    # it would run eagerly, materialising x ⊙ W, and the measurement would say nothing of the compiled form
    with torch._dynamo.config.patch(recompile_limit=1024, fail_on_recompile_limit_hit=True):
        for repetition in range(repeats + 1):
            for name, run in candidates.items():
                start = time.perf_counter()
                run(inputs, weights)
                if repetition:  # the first pass compiles and warms the caches
                    times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    return {"matvec": min(medians, key=medians.get), "blas_ms": medians["blas"],
            "reduction_ms": medians["reduction"]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def greedy_decode(step: Callable, model: nn.Module, cache, logits: torch.Tensor, start: int,
                  steps: int) -> tuple[torch.Tensor, list[float]]:
    """``steps`` greedy tokens after ``logits [b, 1, V]`` (the prefill's), the first at position ``start``.

    ``step(tokens, position, cache)`` is ``decode_step`` (eager) or ``compile_step(model)``. Returns the
    tokens ``[b, steps]`` and the wall time of every step (device synchronised), seconds.
    """
    tokens = logits.argmax(-1)  # [b, 1]
    device = tokens.device
    chosen, seconds = [], []
    for index in range(steps):
        position = torch.full((1, 1), start + index, dtype=torch.long, device=device)
        _sync(device)
        begin = time.perf_counter()
        logits = step(tokens, position, cache)
        tokens = logits[:, -1:].argmax(-1)
        _sync(device)
        seconds.append(time.perf_counter() - begin)
        chosen.append(tokens)
    return torch.cat(chosen, dim=1), seconds


def _repeat_to(cached: torch.Tensor, have: int, context: int, dim: int) -> torch.Tensor:
    """``cached`` (``have`` entries along ``dim``) repeated cyclically to ``context`` entries."""
    index = torch.arange(context, device=cached.device) % have
    return cached.narrow(dim, 0, have).index_select(dim, index)


def _fill_layer(layer, have: int, context: int) -> None:
    if isinstance(layer, HybridCacheLayer):  # constant state: only the token counts move
        state, extra = layer.state, context - have
        state.positions.copy_(torch.where(state.valid, state.positions + extra, state.positions))
        # Sinks and sparse-cache keys are older tokens: they keep their positions.
        state.num_tokens.add_(extra)
        if isinstance(layer, StaticHybridCacheLayer):
            layer.seen_tokens.add_(extra)
        else:
            layer.seen_tokens += extra
        return
    if isinstance(layer, StaticLayer):  # StaticCache and StaticLatentCache layers: write in place
        if context > layer.max_cache_len:
            raise ValueError(f"context {context} exceeds the static cache's {layer.max_cache_len} slots")
        layer.keys[:, :, :context] = _repeat_to(layer.keys, have, context, 2)
        layer.values[:, :, :context] = _repeat_to(layer.values, have, context, 2)
        layer.cumulative_length.fill_(context)
        if isinstance(layer, StaticLatentCacheLayer) and layer.positions is not None:
            layer.positions[:, :context] = torch.arange(context, device=layer.positions.device)
        return
    if isinstance(layer, DynamicLayer):
        layer.keys = _repeat_to(layer.keys, have, context, 2)
        layer.values = _repeat_to(layer.values, have, context, 2)
        if isinstance(layer, LatentCacheLayer) and layer.positions is not None:
            positions = torch.arange(context, device=layer.positions.device, dtype=layer.positions.dtype)
            layer.positions = positions.expand(layer.positions.shape[0], -1).contiguous()
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = context
        return
    raise TypeError(f"cannot fill a {type(layer).__name__} cache layer")


@torch.inference_mode()
def fill_cache(model: nn.Module, cache, ids: torch.Tensor, context: int) -> torch.Tensor:
    """Prefill ``ids [b, n]`` (n ≤ context) into ``cache``, then grow it to ``context`` tokens (module
    docstring); returns the prefill's last logits ``[b, 1, V]``. Sliding-window layers are not supported."""
    have = ids.shape[1]
    if have > context:
        raise ValueError(f"the prefill ({have} tokens) is longer than the context ({context})")
    logits = prefill(model, ids, cache)
    if context > have:
        for layer in cache.layers:
            _fill_layer(layer, have, context)
    return logits


class SkippedProjection(nn.Module):
    """Stands in for a projection ``[..., d] -> [..., d_out]``: returns zeros, reads no weight.

    out = x[..., :1] · gain + source, with ``gain`` [1] and ``source`` [d_out] zero buffers. A compiler must
    keep what feeds the floor: zeros made as a constant (``new_zeros``) with no use of ``x`` make everything
    before them dead code — an ``o_proj`` that ignores its input lets inductor drop the whole attention —
    and the floor would time less than the work it is meant to keep. Buffers are read at run time, and the
    one column of ``x`` they multiply keeps its producers alive.
    """

    def __init__(self, out_features: int, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.out_features = int(out_features)
        self.register_buffer("gain", torch.zeros(1, dtype=dtype, device=device), persistent=False)
        self.register_buffer("source", torch.zeros(self.out_features, dtype=dtype, device=device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., :1] * self.gain.to(x.dtype) + self.source.to(x.dtype)


def _out_features(module: nn.Module) -> int:
    if hasattr(module, "out_features"):
        return int(module.out_features)
    raise TypeError(f"{type(module).__name__} has no out_features; cannot skip it")


def skip_projections(model: nn.Module) -> nn.Module:
    """A copy of ``model`` (softmax attention only) with every decoder projection and the LM head skipped.

    The weights of the skipped modules are not copied. Latent or hybrid attention reads its projections'
    factors directly, so the floor is defined on a softmax-attention model (the original).
    """
    if model_kind(model) != "softmax":
        raise ValueError("the overhead floor skips the projections of a softmax-attention model (the original)")
    adapter = adapter_for(model)
    skipped = {id(adapter.get_linear(layer, name)) for layer in adapter.decoder_layers(model)
               for name in adapter.linear_names}
    head = model.get_output_embeddings()
    skipped.add(id(head))
    kept = {id(p) for m in model.modules() if id(m) not in skipped for p in m.parameters(recurse=False)}
    # memo: the skipped weights are never copied (a weight tied to a kept module, the embeddings, is)
    memo = {id(p): None for m in model.modules() if id(m) in skipped for p in m.parameters() if id(p) not in kept}
    floor = copy.deepcopy(model, memo)
    embedding = floor.get_input_embeddings().weight
    where = dict(dtype=embedding.dtype, device=embedding.device)
    for layer in adapter.decoder_layers(floor):
        for name in adapter.linear_names:
            adapter.set_linear(layer, name, SkippedProjection(_out_features(adapter.get_linear(layer, name)), **where))
    floor.set_output_embeddings(SkippedProjection(_out_features(floor.get_output_embeddings()), **where))
    return floor
