"""Process resources: peak resident memory and a wall-clock timer."""

from __future__ import annotations

import resource
import sys
import time
from contextlib import contextmanager

__all__ = ["peak_rss_mb", "timed"]


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


@contextmanager
def timed(timings: dict, key: str):
    """Add the wall time of the ``with`` body to ``timings[key]`` (seconds)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - start
