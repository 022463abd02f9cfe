"""Speed without the framework's overhead: prefill and decode, eager and ``torch.compile``d, batch b, any model kind.

For every timed repetition (``warmup`` untimed ones first; the first also compiles), every mode
(``"eager"``, ``"compiled"``), batch size b, context n and model in turn (interleaved, so that drifts
of the machine hit every model alike):

* **prefill** — one forward of random ids ``[b, prefill_len]`` without a cache, logits of the last
  position only (what generation needs), wall seconds; compiled: the same forward under ``torch.compile``;
* **decode** at context n — a cache of the ``cache`` kind (``decode_loop.make_cache``: ``"static"``
  preallocated for n + ``decode_tokens`` + 1 tokens, the compile-friendly one; ``"dynamic"``: the
  model's own growing cache) holding n tokens (``decode_loop.fill_cache``: a real prefill of
  min(n, ``fill_prefill``) tokens, then grown to n), then ``decode_tokens`` greedy steps of
  ``decode_loop.greedy_decode`` (eager ``decode_step`` or ``compile_step``): ``step_ms`` = median step
  time, ``tokens_per_s`` = b · steps / Σ step times (all rows together);
* **peak memory** of each decode above its starting point (``bench.peak_memory``) and the **cache bytes**
  (every tensor reachable from the filled cache; a static cache counts its preallocated slots).

``floor=True`` adds the overhead floor: the first model with its decoder projections and LM head
skipped (``decode_loop.skip_projections``), measured like the others. Ratios per (mode, batch,
context): ``value / value of the first model``, and ``net`` = ``(value − floor) / (first − floor)``:
the ratio of the time spent in what the floor does not contain (the projections and the head).
"""

from __future__ import annotations

import os
import statistics
import time

import torch
from torch import nn
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from ..data.cache import cache_dir
from .bench import cache_nbytes, machine_info, peak_memory
from .decode_loop import (CACHE_KINDS, MATVEC_CHOICES, choose_matvec, compile_step, decode_step, fill_cache,
                          greedy_decode, make_cache, prepare_for_compile, skip_projections)

__all__ = ["FLOOR_LABEL", "MODES", "bench_decode", "persistent_inductor_cache"]

MODES = ("eager", "compiled")
INDUCTOR_CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
FLOOR_LABEL = "overhead floor"


def _summary(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "samples": samples}


def _ids(batch: int, length: int, vocab: int, seed: int, device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(min(4, vocab - 1), vocab, (batch, length), generator=generator).to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Runner:
    """One model's prefill and decode callables per (mode, batch, context), compiled once and reused."""

    def __init__(self, model: nn.Module, cache_kind: str, backend: str, matvec: str = "blas"):
        self.model, self.cache_kind, self.backend, self.matvec = model, cache_kind, backend, matvec
        self.device = next(model.parameters()).device
        self.vocab = int(model.get_input_embeddings().num_embeddings)
        self.compiled: dict = {}
        self.matvec_choices: dict[int, dict] = {}  # batch -> how its compiled decode step runs linear maps

    def matvec_choice(self, batch: int) -> dict:
        """``choose_matvec``'s measurement for ``matvec="auto"`` (once per batch size), else the given choice."""
        if batch not in self.matvec_choices:
            self.matvec_choices[batch] = (choose_matvec(self.model, rows=batch) if self.matvec == "auto" else
                                          {"matvec": self.matvec, "blas_ms": None, "reduction_ms": None})
        return self.matvec_choices[batch]

    def _forward(self, ids):
        return self.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits

    def prefill_fn(self, mode: str, batch: int):
        if mode == "eager":
            return self._forward
        key = ("prefill", batch)
        if key not in self.compiled:
            prepare_for_compile(self.model)
            self.compiled[key] = torch.compile(self._forward, dynamic=False, backend=self.backend)
        return self.compiled[key]

    def step_fn(self, mode: str, batch: int, context: int):
        if mode == "eager":
            return lambda tokens, position, cache: decode_step(self.model, tokens, position, cache)
        key = ("decode", batch, context)
        if key not in self.compiled:
            rows = batch if self.matvec_choice(batch)["matvec"] == "reduction" else 0
            self.compiled[key] = compile_step(self.model, backend=self.backend, reduction_rows=rows)
        return self.compiled[key]

    def _cache(self, mode: str, batch: int, context: int, steps: int):
        """A fresh dynamic cache; a static one is made once per (mode, batch, context) and reset after
        (a compiled step keeps the addresses of its buffers)."""
        if self.cache_kind == "dynamic":
            return make_cache(self.model, "dynamic")
        key = ("cache", mode, batch, context)
        if key in self.compiled:
            self.compiled[key].reset()
        else:
            self.compiled[key] = make_cache(self.model, "static", max_cache_len=context + steps + 1)
        return self.compiled[key]

    @torch.inference_mode()
    def prefill(self, mode: str, batch: int, length: int, seed: int) -> float:
        ids = _ids(batch, length, self.vocab, seed, self.device)
        forward = self.prefill_fn(mode, batch)
        _sync(self.device)
        start = time.perf_counter()
        forward(ids)
        _sync(self.device)
        return time.perf_counter() - start

    @torch.inference_mode()
    def decode(self, mode: str, batch: int, context: int, steps: int, fill_prefill: int, seed: int) -> dict:
        cache = self._cache(mode, batch, context, steps)
        ids = _ids(batch, min(context, fill_prefill), self.vocab, seed, self.device)
        logits = fill_cache(self.model, cache, ids, context)
        cache_bytes = cache_nbytes(cache)
        record: dict = {}
        with peak_memory(self.device, record):
            _, seconds = greedy_decode(self.step_fn(mode, batch, context), self.model, cache, logits, context, steps)
        return {"step_s": statistics.median(seconds), "tokens_per_s": batch * steps / sum(seconds),
                "peak_mb": record["peak_mb"], "cache_bytes": cache_bytes}


def persistent_inductor_cache() -> str:
    """``TORCHINDUCTOR_CACHE_DIR``: the user's if set, else retrofitter's cache (``data.cache.cache_dir()/inductor``)
    instead of inductor's default under the system's temporary directory. Inductor writes its default into the
    environment the first time anything asks for the directory (importing torchao does), so that value counts as
    unset."""
    current = os.environ.get(INDUCTOR_CACHE_VARIABLE)
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ[INDUCTOR_CACHE_VARIABLE] = str(cache_dir() / "inductor")
    return os.environ[INDUCTOR_CACHE_VARIABLE]


def _matvec_per_label(matvec: str | dict[str, str], labels: list[str]) -> dict[str, str]:
    """``bench_decode``'s ``matvec`` as one choice per model label."""
    return dict(matvec) if isinstance(matvec, dict) else {label: matvec for label in labels}


def _check(models, modes, batch_sizes, contexts, cache, decode_tokens, repeats, warmup, matvec) -> None:
    labels = [label for label, _ in models]
    if not models or len(set(labels)) != len(labels):
        raise ValueError(f"bench_decode needs models with unique labels; got {labels}")
    if FLOOR_LABEL in labels:
        raise ValueError(f"{FLOOR_LABEL!r} is reserved for the overhead floor")
    if not modes or any(mode not in MODES for mode in modes):
        raise ValueError(f"modes must be among {MODES}; got {list(modes)}")
    choices = _matvec_per_label(matvec, labels)
    if set(choices) != set(labels) or any(choice not in MATVEC_CHOICES for choice in choices.values()):
        raise ValueError(f"matvec must be one of {MATVEC_CHOICES}, or one of them per model label {labels}; "
                         f"got {matvec!r}")
    if cache not in CACHE_KINDS:
        raise ValueError(f"cache must be one of {CACHE_KINDS}; got {cache!r}")
    if "compiled" in modes and cache != "static":
        raise ValueError("compiled decoding needs the static cache (a growing cache changes shapes every step)")
    for name, values in (("batch_sizes", batch_sizes), ("contexts", contexts)):
        if not values or any(int(v) < 1 for v in values):
            raise ValueError(f"{name} must be positive; got {list(values)}")
    if decode_tokens < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"need decode_tokens >= 1, repeats >= 1, warmup >= 0; got {decode_tokens}, {repeats}, {warmup}")


def bench_decode(models: list[tuple[str, nn.Module]], *, modes=MODES, batch_sizes=(1,), contexts=(512,),
                 prefill_len: int = 512, decode_tokens: int = 32, cache: str = "static", fill_prefill: int = 512,
                 repeats: int = 3, warmup: int = 1, floor: bool = True, backend: str = "inductor", seed: int = 0,
                 matvec: str | dict[str, str] = "auto", progress: bool = False) -> dict:
    """Benchmark ``models = [(label, model), ...]`` (module docstring); returns the ``"bench_decode"`` dict.

    ``prefill_len=0`` skips the prefill measurement. ``results[mode][str(b)][label]`` holds ``prefill``
    (seconds summary) and ``decode[str(n)]`` (``step_s`` and ``tokens_per_s`` summaries, ``peak_mb``,
    ``cache_bytes``); ``ratios`` has the same keys with ``prefill``/``step`` ratios and their ``net`` forms.
    ``matvec`` (``decode_loop.MATVEC_CHOICES``): how each compiled decode step runs its linear maps; "auto"
    measures it per model and batch size (``decode_loop.choose_matvec``), recorded in the compiled entries'
    ``matvec``; a dict gives each model label its own (benchmarks run one model both ways under two labels).
    """
    modes, batch_sizes, contexts = list(modes), [int(b) for b in batch_sizes], [int(n) for n in contexts]
    _check(models, modes, batch_sizes, contexts, cache, decode_tokens, repeats, warmup, matvec)
    inductor_cache = None
    if "compiled" in modes:  # compiled kernels and graphs persist between runs (minutes of compiling saved)
        inductor_cache = persistent_inductor_cache()
    choices = _matvec_per_label(matvec, [label for label, _ in models])
    runners = {label: _Runner(model, cache, backend, choices[label]) for label, model in models}
    if floor:  # no projection left to run either way
        runners[FLOOR_LABEL] = _Runner(skip_projections(models[0][1]), cache, backend, "blas")
    raw = {mode: {b: {label: {"prefill": [], **{n: [] for n in contexts}} for label in runners}
                  for b in batch_sizes} for mode in modes}
    with torch._dynamo.config.patch(recompile_limit=1024, accumulated_recompile_limit=8192,
                                    fail_on_recompile_limit_hit=True):
        for repetition in range(warmup + repeats):
            for mode in modes:
                for b in batch_sizes:
                    for label, runner in runners.items():
                        if progress:
                            compiling = (" — compiling its prefill and decode step first (minutes on a CPU; inductor "
                                         f"keeps the kernels in {inductor_cache} for later runs)"
                                         if mode == "compiled" and repetition == 0 else "")
                            print(f"[bench_decode] repetition {repetition + 1}/{warmup + repeats} {mode} b={b} {label}"
                                  f"{compiling}", flush=True)
                        samples = raw[mode][b][label]
                        if prefill_len:
                            samples["prefill"].append(runner.prefill(mode, b, prefill_len, seed))
                        for n in contexts:
                            samples[n].append(runner.decode(mode, b, n, decode_tokens, fill_prefill, seed + n))
    results = {mode: {str(b): {label: _entry(raw[mode][b][label], contexts, warmup) for label in runners}
                      for b in batch_sizes} for mode in modes}
    for b, entries in results.get("compiled", {}).items():
        for label, entry in entries.items():
            entry["matvec"] = runners[label].matvec_choice(int(b))
    for by_batch in results.values():
        for entries in by_batch.values():
            _add_ratios(entries, models[0][0])
    return {"kind": "bench_decode",
            "settings": {"modes": modes, "batch_sizes": batch_sizes, "contexts": contexts, "prefill_len": prefill_len,
                         "decode_tokens": decode_tokens, "cache": cache, "fill_prefill": fill_prefill,
                         "repeats": repeats, "warmup": warmup, "floor": floor, "backend": backend, "seed": seed,
                         "matvec": matvec,
                         "inductor_cache": inductor_cache,
                         "labels": list(runners), "logits_to_keep": 1,
                         "dtype": str(next(models[0][1].parameters()).dtype).replace("torch.", "")},
            "machine": machine_info(next(models[0][1].parameters()).device),
            "results": results}


def _entry(samples: dict, contexts: list[int], warmup: int) -> dict:
    entry = {"prefill": _summary(samples["prefill"][warmup:]) if samples["prefill"] else None, "decode": {}}
    for n in contexts:
        timed = samples[n][warmup:]
        entry["decode"][str(n)] = {"step_s": _summary([s["step_s"] for s in timed]),
                                   "tokens_per_s": _summary([s["tokens_per_s"] for s in timed]),
                                   "peak_mb": max(s["peak_mb"] for s in timed), "cache_bytes": timed[-1]["cache_bytes"]}
    return entry


def _ratio(value: float, reference: float, floor: float | None = None) -> float | None:
    if floor is None:
        return value / reference if reference else None
    return (value - floor) / (reference - floor) if reference != floor else None


def _add_ratios(entries: dict, first: str) -> None:
    """``ratios`` of every entry: against the first model, and net of the overhead floor when measured."""
    reference, floor = entries[first], entries.get(FLOOR_LABEL)
    for label, entry in entries.items():
        ratios: dict = {"decode": {}}
        if entry["prefill"] and reference["prefill"]:
            value, base = entry["prefill"]["median"], reference["prefill"]["median"]
            ratios["prefill"] = _ratio(value, base)
            if floor is not None and label != FLOOR_LABEL:
                ratios["prefill_net"] = _ratio(value, base, floor["prefill"]["median"])
        for n, decode in entry["decode"].items():
            value, base = decode["step_s"]["median"], reference["decode"][n]["step_s"]["median"]
            ratios["decode"][n] = {"step": _ratio(value, base)}
            if floor is not None and label != FLOOR_LABEL:
                ratios["decode"][n]["step_net"] = _ratio(value, base, floor["decode"][n]["step_s"]["median"])
        entry["ratios"] = ratios
