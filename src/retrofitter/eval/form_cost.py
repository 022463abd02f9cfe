"""Micro-benchmark of the factor forms on this machine, cached: the timings behind ``eval.cost_model``.

    time_kernel(d_in, d_out, rank, kernel, tokens, dtype, device)   median seconds of y = f(x), x [tokens, d_in]
    measure_timings(requests, tokens, dtype, device)                 a FormCostModel; measures only what
                                                                     the cache lacks

The cache is one JSON file per machine under ``cache_dir()/form_cost/`` (``$RETROFITTER_CACHE``),
named by a hash of the machine key (CPU model, torch version, threads, dtype, device / accelerator
name): ``{"format", "machine", "tokens": {"512": {"<d_in>x<d_out>/<kernel>": {"<rank>": seconds}}}}``.
A second run on the same machine and settings times nothing. Modules are filled with random values:
the time of a matmul does not depend on them (the junction's pivots are a random permutation for
``junction_gather`` and 0..r−1 for ``junction_slice``).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time

import torch
from torch import nn
from tqdm.auto import tqdm

from ..data.cache import atomic_write_text, cache_dir
from ..modules.latent_linear import LatentLinear
from .cost_model import KERNELS, FormCostModel, rank_grid
from .machine import cpu_model

__all__ = ["CACHE_FORMAT", "machine_key", "timings_path", "time_kernel", "kernel_module", "measure_timings",
           "load_timings", "shape_requests"]

CACHE_FORMAT = 1


def machine_key(dtype: torch.dtype, device: torch.device | str) -> dict:
    """What the timings depend on: CPU model, torch version, threads, dtype, device (and accelerator)."""
    device = torch.device(device)
    return {"cpu": cpu_model(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "dtype": str(dtype).replace("torch.", ""), "device": device.type,
            "accelerator": torch.cuda.get_device_name(device) if device.type == "cuda" else None}


def timings_path(key: dict):
    """The cache file of a machine key."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "form_cost" / f"{digest}.json"


def kernel_module(d_in: int, d_out: int, rank: int, kernel: str, dtype: torch.dtype,
                  device: torch.device | str, seed: int = 0) -> nn.Module:
    """A module executing ``kernel`` for a [d_out, d_in] matrix (random values; no bias, as the projections)."""
    generator = torch.Generator().manual_seed(seed)
    if kernel == "dense":
        module = nn.Linear(d_in, d_out, bias=False)
        with torch.no_grad():
            module.weight.copy_(torch.randn(d_out, d_in, generator=generator))
        return module.to(dtype=dtype, device=device)
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; choose from {', '.join(KERNELS)}")
    junction = kernel != "plain"
    module = LatentLinear(d_in, d_out, rank, junction=junction, bias=False)
    with torch.no_grad():
        module.up.copy_(torch.randn(d_out, rank, generator=generator))
        if junction:
            module.mix.copy_(torch.randn(rank, d_in - rank, generator=generator))
            order = torch.randperm(d_in, generator=generator) if kernel == "junction_gather" else torch.arange(d_in)
            module.pivot_index.copy_(order[:rank])
            module.rest_index.copy_(order[rank:])
            module.refresh_layout()
        else:
            module.down.copy_(torch.randn(rank, d_in, generator=generator))
    return module.to(dtype=dtype, device=device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def time_kernel(d_in: int, d_out: int, rank: int, kernel: str, tokens: int = 512, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", repeats: int = 5, warmup: int = 2) -> float:
    """Median seconds of y = f(x) for x [tokens, d_in] over ``repeats`` calls after ``warmup`` ones."""
    device = torch.device(device)
    module = kernel_module(d_in, d_out, rank, kernel, dtype, device)
    x = torch.randn(tokens, d_in, generator=torch.Generator().manual_seed(1)).to(dtype=dtype, device=device)
    samples = []
    for index in range(warmup + repeats):
        _sync(device)
        start = time.perf_counter()
        module(x)
        _sync(device)
        if index >= warmup:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def shape_requests(shapes, pivots_lead_shapes=()) -> dict:
    """(d_in, d_out) -> kernels to time: dense, plain and the junction in the layout each shape runs in.

    ``pivots_lead_shapes``: shapes whose junction pivots lead (the MLP down projection after
    ``adapters.mlp_permutation``); a shape can be in both sets (then both junction layouts are timed).
    """
    requests: dict = {}
    for shape in shapes:
        requests.setdefault(tuple(shape), set()).update({"dense", "plain", "junction_gather"})
    for shape in pivots_lead_shapes:
        requests.setdefault(tuple(shape), set()).update({"dense", "plain", "junction_slice"})
    return {shape: sorted(kernels) for shape, kernels in requests.items()}


def _read(path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return data if data.get("format") == CACHE_FORMAT else {}


def _model_from(data: dict, tokens: int) -> FormCostModel:
    timings = {}
    for name, by_rank in data.get("tokens", {}).get(str(tokens), {}).items():
        shape, kernel = name.split("/")
        d_in, d_out = (int(part) for part in shape.split("x"))
        timings[(d_in, d_out, kernel)] = {int(rank): float(seconds) for rank, seconds in by_rank.items()}
    return FormCostModel(timings, tokens)


def load_timings(tokens: int = 512, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
                 ) -> FormCostModel:
    """The cached cost model of this machine (empty when nothing was measured)."""
    return _model_from(_read(timings_path(machine_key(dtype, device))), tokens)


def measure_timings(requests: dict, tokens: int = 512, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", points: int = 9, repeats: int = 5, use_cache: bool = True,
                    progress: bool = True) -> FormCostModel:
    """Time every (shape, kernel) of ``requests`` ((d_in, d_out) -> kernels, see :func:`shape_requests`) at
    the ranks of ``rank_grid`` (dense: once) that the cache lacks, write the cache, return the model."""
    key = machine_key(dtype, device)
    path = timings_path(key)
    data = _read(path) if use_cache else {}
    data = {"format": CACHE_FORMAT, "machine": key, "tokens": data.get("tokens", {})}
    table = data["tokens"].setdefault(str(tokens), {})
    todo = []
    for (d_in, d_out), kernels in requests.items():
        for kernel in kernels:
            name = f"{d_in}x{d_out}/{kernel}"
            ranks = [0] if kernel == "dense" else rank_grid(d_in, d_out, points)
            todo += [(d_in, d_out, kernel, rank, name) for rank in ranks if str(rank) not in table.get(name, {})]
    for d_in, d_out, kernel, rank, name in tqdm(todo, desc="form timings", disable=not progress or not todo):
        table.setdefault(name, {})[str(rank)] = time_kernel(d_in, d_out, rank, kernel, tokens, dtype, device, repeats)
    if todo and use_cache:
        atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
    return _model_from(data, tokens)
