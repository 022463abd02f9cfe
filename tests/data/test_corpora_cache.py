"""load_text forms and errors; the cache helpers (location, atomic writes, manifests)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from retrofitter.data import cache
from retrofitter.data.corpora import check_corpus, load_text, parse_hf_spec


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


def test_corpora_joined_by_commas_are_read_in_order(tmp_path):
    (tmp_path / "a.txt").write_text("first text\n\n")
    (tmp_path / "b.txt").write_text("second text\n")
    joined = f"{tmp_path / 'b.txt'},{tmp_path / 'a.txt'}"
    check_corpus(joined, "--calib")
    assert load_text(joined) == "second text\n\nfirst text"
    odd = tmp_path / "one,file.txt"  # an existing path with a comma is one corpus
    odd.write_text("whole")
    assert load_text(str(odd)) == "whole"
    with pytest.raises(ValueError, match="--calib '.*missing.txt': no such corpus"):
        check_corpus(f"{tmp_path / 'a.txt'},{tmp_path / 'missing.txt'}", "--calib")
    with pytest.raises(ValueError, match="has an empty entry"):
        load_text(f"{tmp_path / 'a.txt'},,{tmp_path / 'b.txt'}")
    with pytest.raises(ValueError, match="^--calib: corpus list .* has an empty entry"):
        check_corpus("wiki-calib,", "--calib")


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
    target.write_text("hello world")  # another size: not complete (fetched again)
    assert not cache.manifest_is_complete("x")
    assert not cache.manifest_is_complete("never-fetched")


def _flip_one_byte(path: Path, keep_mtime: bool) -> None:
    import os

    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    if keep_mtime:  # bit rot: the bytes change, the size and the modification time do not
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_damaged_file_is_named_with_its_repair(isolated_cache, monkeypatch):
    target = cache.atomic_write_text(cache.corpora_dir() / "x.txt", "hello, world")
    cache.write_manifest("x", [target], sources=[], stats={})
    hashed = []
    sha256 = cache.sha256_file
    monkeypatch.setattr(cache, "sha256_file", lambda p: hashed.append(p) or sha256(p))
    assert cache.manifest_is_complete("x") and hashed == []  # stamped at fetch: a use only stats the files
    _flip_one_byte(target, keep_mtime=False)  # an edit: the stamp no longer matches, so it is hashed
    with pytest.raises(cache.CacheDamagedError, match=r"x.txt does not match .* retrofitter fetch x --force"):
        cache.manifest_is_complete("x")
    cache.write_manifest("x", [target], sources=[], stats={})
    _flip_one_byte(target, keep_mtime=True)
    assert cache.manifest_is_complete("x")  # the cheap check cannot see bit rot ...
    with pytest.raises(cache.CacheDamagedError, match="x.txt"):
        cache.manifest_is_complete("x", verify_checksums=True)  # ... fetch's full check does


def test_fetch_command_verifies_every_byte_and_eval_refuses_a_damaged_corpus(isolated_cache, tmp_path, capsys):
    from retrofitter.cli import main
    from tiny_models import save_tiny_model_dir

    austen = cache.atomic_write_text(cache.corpora_dir() / "austen.txt", "It is a truth universally acknowledged. " * 40)
    cache.write_manifest("austen", [austen], sources=[], stats={})
    assert main(["fetch", "austen", "--quiet"]) == 0
    _flip_one_byte(austen, keep_mtime=True)
    assert main(["fetch", "austen", "--quiet"]) == 2
    assert "austen.txt does not match the checksum" in capsys.readouterr().err
    _flip_one_byte(austen, keep_mtime=False)  # flipped back: the original bytes, a new mtime
    model = save_tiny_model_dir(tmp_path / "m", "llama")
    capsys.readouterr()
    assert main(["eval", str(model), "--ppl", "austen", "--seq-len", "32", "--quiet"]) == 0  # hashed again: intact
    capsys.readouterr()
    _flip_one_byte(austen, keep_mtime=False)
    assert main(["eval", str(model), "--ppl", "austen", "--seq-len", "32", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "retrofitter fetch austen --force" in err[0], err


def test_a_cache_that_cannot_be_written_is_still_read(isolated_cache):
    target = cache.atomic_write_text(cache.corpora_dir() / "x.txt", "hello")
    cache.write_manifest("x", [target], sources=[], stats={})
    (isolated_cache / "locks").write_text("a file where the lock directory would go")  # no lock can be created
    cache.manifest_path("x").with_name("x.verified.json").unlink()
    (isolated_cache / "manifests").chmod(0o555)  # (root ignores it; the lock above is the check that holds)
    try:
        with cache.item_lock("x"):
            assert cache.manifest_is_complete("x")
    finally:
        (isolated_cache / "manifests").chmod(0o755)


def test_atomic_move_dir_replaces_a_stale_directory(tmp_path):
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "f").write_text("new")
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "old").write_text("old")
    cache.atomic_move_dir(tmp_path / "new", tmp_path / "target")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]
    assert [p.name for p in (tmp_path / "target").iterdir()] == ["f"]
