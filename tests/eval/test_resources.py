"""Process-resource helpers: the sampled RSS of a block and the timer."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from retrofitter.eval.resources import peak_rss_mb, release_free_heap_memory, sampled_rss, timed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS semantics checked on Linux")
def test_sampled_rss_reads_the_size_of_an_allocation_made_twice():
    """Each of two identical blocks reads its own allocation (about 96 MiB), not 0 the second time."""
    chunks, chunk_bytes = 96, 2**20
    for _ in range(2):
        record: dict = {}
        with sampled_rss(record):
            buffers = [torch.ones(chunk_bytes // 4, dtype=torch.float32) for _ in range(chunks)]
            time.sleep(0.05)
            del buffers
        assert 0.8 * chunks < record["delta_mb"] < 4 * chunks, record
        assert record["peak_mb"] == pytest.approx(record["start_mb"] + record["delta_mb"])
        assert record["peak_mb"] <= peak_rss_mb() + 1


def test_sampled_rss_of_an_empty_block_is_small():
    record: dict = {}
    with sampled_rss(record):
        pass
    assert 0 <= record["delta_mb"] < 16


def test_release_free_heap_memory_runs_on_linux():
    if sys.platform.startswith("linux"):  # glibc here; other C libraries have no malloc_trim
        assert release_free_heap_memory() is True


def test_timed_accumulates():
    timings: dict = {}
    for _ in range(2):
        with timed(timings, "work"):
            time.sleep(0.01)
    assert timings["work"] >= 0.02
