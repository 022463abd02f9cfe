"""Measured speed and memory of several models, side by side, in one process.

For each repetition ``r`` (``warmup`` discarded ones first, then ``repeats``) and each model in turn
(A, B, A, B, ... so that slow drifts of the machine hit every model alike):

* **prefill latency** — one forward of ``ids [1, prefill_len]`` with ``use_cache=True``, seconds;
* **decode speed** at each context ``n`` — ``model.generate`` on ``ids [1, n]`` (random token ids,
  the same for every model) for ``decode_tokens + 1`` greedy tokens with the model's own cache.
  The first new token comes out of the prefill, so only the ``decode_tokens`` steps after it are
  timed: ``tokens_per_s = decode_tokens / (t_last - t_first)`` where ``t_i`` is the moment token ``i``
  reached the streamer (after a device sync);
* **peak memory** of each measurement above its starting point: CUDA ``max_memory_allocated`` on a
  GPU, otherwise the process RSS sampled by a background thread (torch's CPU allocator bypasses
  ``tracemalloc``) after the C heap's free pages went back to the OS (``malloc_trim``), in MiB, the maximum over the timed repetitions (the warm-up is excluded: it
  also pages in memory-mapped weights);
* **cache bytes** at each context, measured once per model: the bytes of every tensor reachable from
  the cache object returned by a prefill of ``n`` tokens (attributes, lists, dicts and layers, walked
  recursively, each storage counted once) — valid for any cache class, latent or constant-state too;
* **KV bytes per token** from :func:`retrofitter.eval.accounting.account` (a module's own
  ``cache_numbers_per_token()`` when it declares one), and the weights' ``stored_bytes`` (int8 data
  and scales of a model quantized by ``modules.quantize``, whose scheme is under ``quantize``).

Ratios are ``value(model) / value(first model)`` for every figure (a decode-speed ratio above 1 and
a latency ratio below 1 both mean "faster than the first model").
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from ..modules.quantize import quantized_scheme
from .accounting import account
from .machine import cpu_model
from .resources import sampled_rss

__all__ = ["bench_models", "cache_nbytes", "machine_info", "peak_memory", "unique_labels"]



# ----------------------------------------------------------------------------------------------
# cache size: walk any cache object
# ----------------------------------------------------------------------------------------------
def cache_nbytes(cache, max_depth: int = 12) -> int:
    """Bytes of all tensors reachable from ``cache`` (a Cache object, tuple of tuples, dict, ...).

    Walks attributes (``__dict__`` and ``__slots__``), lists, tuples, sets and dict values; tensors
    sharing a storage count once (largest view wins). ``nn.Module`` instances are not entered, so a
    cache that keeps a reference to its layer does not count the layer's weights.
    """
    storages: dict[int, int] = {}
    visited: set[int] = set()

    def walk(obj, depth: int) -> None:
        if obj is None or depth > max_depth or id(obj) in visited:
            return
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "meta" or obj.numel() == 0:
                return
            key = obj.untyped_storage().data_ptr()
            storages[key] = max(storages.get(key, 0), obj.nbytes)
            return
        if isinstance(obj, (str, bytes, int, float, bool, torch.dtype, torch.device, nn.Module)):
            return
        if isinstance(obj, dict):
            children = list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = list(obj)
        else:
            children = list(getattr(obj, "__dict__", {}).values())
            for slot in getattr(type(obj), "__slots__", ()):
                children.append(getattr(obj, slot, None))
        for child in children:
            walk(child, depth + 1)

    walk(cache, 0)
    return sum(storages.values())


def _cache_from_output(output):
    """The cache object of a model output, whatever the transformers version calls it."""
    for key in ("cache", "past_key_values"):
        if key in output and output[key] is not None:  # ModelOutput is a dict: no deprecated attribute access
            return output[key]
    raise ValueError("the model returned no cache with use_cache=True; cannot measure cache bytes")


# ----------------------------------------------------------------------------------------------
# timing and memory primitives
# ----------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def peak_memory(device: torch.device, record: dict) -> Iterator[None]:
    """Set ``record["peak_mb"]``: peak memory above the starting point during the body, MiB."""
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        try:
            yield
        finally:
            _sync(device)
            record["peak_mb"] = (torch.cuda.max_memory_allocated(device) - start) / 2**20
        return
    sampled: dict = {}
    with sampled_rss(sampled):
        yield
    record["peak_mb"] = sampled["delta_mb"]


class _TokenTimer:
    """A ``generate`` streamer that stamps the time each new token arrives (after a device sync)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.prompt_seen = False
        self.stamps: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate first hands over the prompt itself
            self.prompt_seen = True
            return
        _sync(self.device)
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def _summary(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "samples": samples}


def _random_ids(n: int, vocab_size: int, seed: int, device: torch.device) -> torch.Tensor:
    """``[1, n]`` token ids in ``[4, vocab)`` (skips the usual special ids), same for every model."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(min(4, vocab_size - 1), vocab_size, (1, n), generator=generator).to(device)


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _vocab_size(model: nn.Module) -> int:
    return int(model.get_input_embeddings().num_embeddings)


# ----------------------------------------------------------------------------------------------
# one measurement each
# ----------------------------------------------------------------------------------------------
@torch.inference_mode()
def _measure_prefill(model: nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    """(seconds, peak MiB) of one forward over ``ids [1, n]`` with ``use_cache=True``."""
    device = ids.device
    record: dict = {}
    with peak_memory(device, record):
        _sync(device)
        start = time.perf_counter()
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
        _sync(device)
        elapsed = time.perf_counter() - start
    return elapsed, record["peak_mb"]


@torch.inference_mode()
def _measure_decode(model: nn.Module, tokenizer, ids: torch.Tensor, decode_tokens: int) -> tuple[float, float]:
    """(tokens/s over ``decode_tokens`` greedy steps after the prefill of ``ids``, peak MiB)."""
    device = ids.device
    timer = _TokenTimer(device)
    new_tokens = decode_tokens + 1  # the first one comes out of the (untimed) prefill
    pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is None:
        pad_id = getattr(tokenizer, "eos_token_id", None) or 0
    record: dict = {}
    with peak_memory(device, record):
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, num_beams=1, use_cache=True,
                       pad_token_id=pad_id, streamer=timer, temperature=None, top_p=None, top_k=None)
    if len(timer.stamps) != new_tokens:
        raise RuntimeError(f"generate produced {len(timer.stamps)} tokens, expected {new_tokens}")
    return decode_tokens / (timer.stamps[-1] - timer.stamps[0]), record["peak_mb"]


@torch.inference_mode()
def _measure_cache(model: nn.Module, ids: torch.Tensor) -> int:
    output = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
    return cache_nbytes(_cache_from_output(output))


# ----------------------------------------------------------------------------------------------
# the benchmark
# ----------------------------------------------------------------------------------------------
def machine_info(device: torch.device | str = "cpu") -> dict:
    """CPU model, threads, accelerator, library versions and the date: what a reader needs to compare runs."""
    import transformers

    device = torch.device(device)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "accelerator": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def _accounting(model: nn.Module) -> dict:
    """Predicted figures (any causal LM; ``kv_bytes_per_token`` is None where the config cannot tell)."""
    accounting = account(model)
    return {"params": accounting.params_dict(), "kv_bytes_per_token": accounting.kv_bytes_per_token,
            "dtype": accounting.dtype, "stored_bytes": accounting.stored_bytes, "quantize": quantized_scheme(model)}


def unique_labels(names: list[str]) -> list[str]:
    """``["a", "b", "a"] -> ["a", "b", "a#2"]``: the same model may be benched twice (a noise check)."""
    seen: dict[str, int] = {}
    labels = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        labels.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return labels


def _check_settings(models, prefill_len, contexts, decode_tokens, repeats, warmup) -> None:
    if not models:
        raise ValueError("bench_models needs at least one (label, model, tokenizer)")
    labels = [label for label, _, _ in models]
    if len(set(labels)) != len(labels):
        raise ValueError(f"model labels must be unique; got {labels}")
    for name, value, low in (("prefill_len", prefill_len, 1), ("decode_tokens", decode_tokens, 1),
                             ("repeats", repeats, 1), ("warmup", warmup, 0)):
        if int(value) < low:
            raise ValueError(f"{name} must be >= {low}; got {value}")
    if not contexts or any(int(n) < 1 for n in contexts):
        raise ValueError(f"contexts must be positive token counts; got {list(contexts)}")


def bench_models(models: list[tuple[str, nn.Module, object]], prefill_len: int = 512,
                 contexts=(256, 1024, 4096), decode_tokens: int = 32, repeats: int = 3, warmup: int = 1,
                 seed: int = 0, progress: bool = False) -> dict:
    """Benchmark ``models`` = ``[(label, model, tokenizer), ...]`` interleaved; returns the bench dict.

    The dict (``"kind": "bench"``) holds ``settings``, ``machine`` and per model ``prefill``
    (``latency_s`` summary), ``decode[str(n)]`` (``tokens_per_s`` summary, ``cache_bytes``),
    ``peak_memory_mb``, ``kv_bytes_per_token``, ``skipped`` (context -> reason) and ``ratios``.
    A summary is ``{"median", "min", "max", "samples"}`` plus warm-up samples under ``"warmup"``.
    """
    _check_settings(models, prefill_len, contexts, decode_tokens, repeats, warmup)
    contexts = list(dict.fromkeys(int(n) for n in contexts))  # keep order, drop repeats
    reference_device = _model_device(models[0][1])  # settings and machine info describe the first model's device
    entries = []
    for label, model, _ in models:
        limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        entry = {"label": label, "model": getattr(model, "name_or_path", type(model).__name__),
                 "class": type(model).__name__, "max_position_embeddings": limit, **_accounting(model),
                 "skipped": {}, "prefill": None, "decode": {}}
        if limit is not None and prefill_len > limit:
            entry["skipped"]["prefill"] = f"prefill_len {prefill_len} exceeds max_position_embeddings {limit}"
        for n in contexts:
            if limit is not None and n + decode_tokens + 1 > limit:
                entry["skipped"][str(n)] = (f"context {n} + {decode_tokens + 1} new tokens exceeds "
                                            f"max_position_embeddings {limit}")
        entries.append(entry)

    raw = [{"prefill": [], "prefill_mem": [], **{str(n): [] for n in contexts}, **{f"mem{n}": [] for n in contexts}}
           for _ in models]
    for repetition in range(warmup + repeats):
        for (label, model, tokenizer), entry, samples in zip(models, entries, raw):
            if progress:
                print(f"[bench] repetition {repetition + 1}/{warmup + repeats} {label}", flush=True)
            vocab, device = _vocab_size(model), _model_device(model)
            if "prefill" not in entry["skipped"]:
                seconds, peak = _measure_prefill(model, _random_ids(prefill_len, vocab, seed, device))
                samples["prefill"].append(seconds)
                samples["prefill_mem"].append(peak)
            for n in contexts:
                if str(n) in entry["skipped"]:
                    continue
                rate, peak = _measure_decode(model, tokenizer, _random_ids(n, vocab, seed + n, device), decode_tokens)
                samples[str(n)].append(rate)
                samples[f"mem{n}"].append(peak)

    for (label, model, _), entry, samples in zip(models, entries, raw):
        vocab, device = _vocab_size(model), _model_device(model)
        peaks = {}
        if "prefill" not in entry["skipped"]:
            entry["prefill"] = {"tokens": prefill_len, "latency_s": {**_summary(samples["prefill"][warmup:]),
                                                                     "warmup": samples["prefill"][:warmup]}}
            # timed repetitions only: the warm-up also pages in mmap-loaded weights, which is not the model's cost
            peaks["prefill"] = max(samples["prefill_mem"][warmup:])
        for n in contexts:
            if str(n) in entry["skipped"]:
                continue
            cache_bytes = _measure_cache(model, _random_ids(n, vocab, seed + n, device))
            entry["decode"][str(n)] = {
                "context": n, "decode_tokens": decode_tokens,
                "tokens_per_s": {**_summary(samples[str(n)][warmup:]), "warmup": samples[str(n)][:warmup]},
                "cache_bytes": cache_bytes, "cache_bytes_per_token": cache_bytes / n,
            }
            peaks[f"decode_{n}"] = max(samples[f"mem{n}"][warmup:])
        entry["peak_memory_mb"] = peaks
    _add_ratios(entries)
    return {
        "kind": "bench",
        "settings": {"prefill_len": prefill_len, "contexts": contexts, "decode_tokens": decode_tokens,
                     "repeats": repeats, "warmup": warmup, "seed": seed, "batch_size": 1,
                     "dtype": str(next(models[0][1].parameters()).dtype).replace("torch.", ""),
                     "memory_measure": ("cuda_max_allocated" if reference_device.type == "cuda"
                                        else "rss_delta_sampled")},
        "machine": machine_info(reference_device),
        "models": entries,
    }


def _ratio(value, reference):
    if value is None or reference in (None, 0):
        return None
    return value / reference


def _add_ratios(entries: list[dict]) -> None:
    """``ratios`` of every entry against the first: value / value of the first model."""
    first = entries[0]
    for entry in entries:
        ratios = {"params_total": _ratio(entry["params"].get("total"), first["params"].get("total")),
                  "kv_bytes_per_token": _ratio(entry["kv_bytes_per_token"], first["kv_bytes_per_token"]),
                  "decode_tokens_per_s": {}, "cache_bytes": {}}
        if entry["prefill"] and first["prefill"]:
            ratios["prefill_latency"] = _ratio(entry["prefill"]["latency_s"]["median"],
                                               first["prefill"]["latency_s"]["median"])
        for n, decode in entry["decode"].items():
            reference = first["decode"].get(n)
            if reference:
                ratios["decode_tokens_per_s"][n] = _ratio(decode["tokens_per_s"]["median"],
                                                          reference["tokens_per_s"]["median"])
                ratios["cache_bytes"][n] = _ratio(decode["cache_bytes"], reference["cache_bytes"])
        entry["ratios"] = ratios
