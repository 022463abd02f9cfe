"""Process resources: peak resident memory (whole process, or sampled over a block) and a timer."""

from __future__ import annotations

import resource
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

__all__ = ["available_memory_bytes", "current_rss_mb", "peak_rss_mb", "release_free_heap_memory", "sampled_rss",
           "timed"]

RSS_SAMPLE_INTERVAL_S = 0.002


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def current_rss_mb() -> float:
    """Resident set size of this process now, in MiB."""
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def available_memory_bytes(device) -> int:
    """Memory a new allocation on ``device`` can take now: a CUDA device's free memory, else the host's available
    memory (``psutil``: free plus reclaimable page cache)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


@contextmanager
def timed(timings: dict, key: str):
    """Add the wall time of the ``with`` body to ``timings[key]`` (seconds)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - start


def release_free_heap_memory() -> bool:
    """Return the C heap's free pages to the OS (glibc ``malloc_trim(0)``); False where unavailable.

    Makes an RSS delta measure what a computation allocates rather than what the allocator had to
    fetch on top of the free memory it already held from earlier work.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


@contextmanager
def sampled_rss(record: dict, interval_s: float = RSS_SAMPLE_INTERVAL_S) -> Iterator[None]:
    """Sample the process RSS during the body from a background thread; fills ``record`` with
    ``start_mb``, ``peak_mb`` (absolute) and ``delta_mb`` = peak − start, in MiB.

    Unlike :func:`peak_rss_mb` (the process's all-time peak) this isolates one block of work in a
    long process. Free heap pages are returned to the OS first (see :func:`release_free_heap_memory`).
    """
    import psutil

    release_free_heap_memory()
    process = psutil.Process()
    start = process.memory_info().rss
    peak = [start]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            stop.wait(interval_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield
    finally:
        stop.set()
        sampler.join()
        peak[0] = max(peak[0], process.memory_info().rss)
        record.update(start_mb=start / 2**20, peak_mb=peak[0] / 2**20, delta_mb=(peak[0] - start) / 2**20)
