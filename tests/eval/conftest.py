"""Shared fixtures of the eval tests."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Timing-shaped tests run on one torch thread (and restore the caller's count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
