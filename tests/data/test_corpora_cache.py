"""load_text forms and errors; the cache helpers (location, atomic writes, manifests)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from retrofitter.data import cache
from retrofitter.data.corpora import load_text, parse_hf_spec


def test_local_file_and_directory(tmp_path):
    (tmp_path / "b.txt").write_text("second\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("third")
    (tmp_path / "a.txt").write_text("first\n")
    (tmp_path / "skip.md").write_text("not text")
    assert load_text(tmp_path / "a.txt") == "first\n"
    assert load_text(str(tmp_path)) == "first\n\nsecond\n\nthird"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="contains no .txt files"):
        load_text(str(tmp_path / "empty"))


def test_unknown_corpus_lists_builtins_and_forms(tmp_path):
    with pytest.raises(ValueError, match=r"unknown corpus 'wikipedia': expected a built-in corpus \(austen, wiki-calib, "
                                         r"wiki-eval\), a path .* or hf:<dataset>\[:<config>\]\[:<split>\]"):
        load_text("wikipedia")


def test_hf_spec_parsing_and_missing_datasets(monkeypatch):
    assert parse_hf_spec("hf:wikitext:wikitext-2-raw-v1:test") == ("wikitext", "wikitext-2-raw-v1", "test")
    assert parse_hf_spec("hf:allenai/c4") == ("allenai/c4", None, "train")
    assert parse_hf_spec("hf:ds::validation") == ("ds", None, "validation")
    with pytest.raises(ValueError, match="bad HF corpus spec"):
        parse_hf_spec("hf:")
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ImportError, match="pip install datasets"):
        load_text("hf:wikitext:wikitext-2-raw-v1:test")


def test_builtin_corpus_reads_the_fetched_file(monkeypatch, isolated_cache):
    import retrofitter.data.fetch as fetch_module

    requested = []

    def fake_fetch(names, progress=True):
        requested.extend(names)
        cache.atomic_write_text(cache.corpora_dir() / "austen.txt", "It is a truth universally acknowledged.\n")
        return {}

    monkeypatch.setattr(fetch_module, "fetch", fake_fetch)
    assert load_text("austen", progress=False) == "It is a truth universally acknowledged.\n"
    assert requested == ["austen"]


def test_cache_dir_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("RETROFITTER_CACHE", str(tmp_path / "c"))
    assert cache.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("RETROFITTER_CACHE")
    assert cache.cache_dir() == Path.home() / ".cache" / "retrofitter"


def test_atomic_writes_and_manifest_verification(isolated_cache):
    target = cache.atomic_write_text(cache.corpora_dir() / "x.txt", "hello")
    assert target.read_text() == "hello" and [p.name for p in target.parent.iterdir()] == ["x.txt"]
    assert cache.sha256_file(target) == cache.sha256_bytes(b"hello")
    cache.write_manifest("x", [target], sources=[{"package": "p"}], stats={"words": 1})
    assert cache.manifest_is_complete("x", verify_checksums=True)
    target.write_text("jello")  # same size, different bytes: only the full check notices
    assert cache.manifest_is_complete("x") and not cache.manifest_is_complete("x", verify_checksums=True)
    target.write_text("hello world")
    assert not cache.manifest_is_complete("x")
    assert not cache.manifest_is_complete("never-fetched")


def test_atomic_move_dir_replaces_a_stale_directory(tmp_path):
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "f").write_text("new")
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "old").write_text("old")
    cache.atomic_move_dir(tmp_path / "new", tmp_path / "target")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]
    assert [p.name for p in (tmp_path / "target").iterdir()] == ["f"]
