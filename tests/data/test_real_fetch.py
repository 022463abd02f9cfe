"""The real corpora fetch from PyPI and Debian (network to the package registries, ~10-60 s)."""

from __future__ import annotations

import time

import pytest

from retrofitter.data.cache import read_manifest, sha256_file
from retrofitter.data.fetch import fetch

# The corpora every published figure was measured on (r-cran-janeaustenr 1.0.0-1, gensim 4.4.0's dump).
CORPUS_SHA256 = {"austen": "bf5c1d6389871025b6e18e1aaa699065619552e08c41934e020f4406d0c8debe",
                 "wiki-calib": "8c4ef7dad76f7674448df3d978bd15900c6fd7963504cc3fb9b234c4722a750e",
                 "wiki-eval": "6a58fbb3d67cb1c722fe521e1a9689afa9b599a126d3774855eba69a6eb84fc4"}


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
    assert {name: sha256_file(path) for name, path in paths.items()} == CORPUS_SHA256
    recorded = {record["path"]: record["sha256"] for item in ("wiki", "austen") for record in read_manifest(item)["files"]}
    assert recorded == {f"corpora/{name}.txt": sha256 for name, sha256 in CORPUS_SHA256.items()}
    started = time.perf_counter()
    assert fetch(["wiki", "austen"], progress=False) == paths
    assert time.perf_counter() - started < 1.0  # second fetch only checks manifests
