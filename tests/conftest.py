"""Shared fixtures: tiny random HF models of every supported family, built from configs (no download)."""

from __future__ import annotations

import os

import pytest
import torch

from tiny_models import FAMILIES, SAMPLE_TEXT, TINY_VOCAB, build_tiny, save_tiny_model_dir



@pytest.fixture(params=FAMILIES)
def tiny_model(request):
    return build_tiny(request.param)

@pytest.fixture
def tiny_llama():
    return build_tiny("llama")

@pytest.fixture
def tiny_opt():
    return build_tiny("opt")

@pytest.fixture
def workspace(tmp_path):
    """(tmp_path, a saved tiny Llama directory, a small text corpus file) for command-line tests."""
    model_dir = save_tiny_model_dir(tmp_path / "tiny", "llama")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SAMPLE_TEXT * 3)
    return tmp_path, model_dir, corpus

@pytest.fixture
def random_ids():
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, TINY_VOCAB, (2, 24), generator=generator)

@pytest.fixture(autouse=True)
def _threads_for_test(request):
    """Tiny models run fastest on one thread (OpenMP spin-waits cost more than they give on tiny
    matmuls, badly so on a loaded machine); real-model tests use every core."""
    previous = torch.get_num_threads()
    real = request.node.get_closest_marker("real_model") is not None
    torch.set_num_threads((os.cpu_count() or 1) if real else 1)
    yield
    torch.set_num_threads(previous)

@pytest.fixture(autouse=True)
def _no_native_bfloat16(monkeypatch):
    """"auto" autocast (pipelines/training.py) resolves to float32 in every test, so every CPU runs the same steps
    (bfloat16 is native on some CI machines and not on others); a test of "auto" patches its own answer."""
    import retrofitter.pipelines.training as training

    monkeypatch.setattr(training, "native_bfloat16", lambda device: False)
