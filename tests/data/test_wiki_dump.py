"""Wikipedia dump parsing and the calibration/evaluation split, on a tiny synthetic bz2 dump."""

from __future__ import annotations

import dataclasses

import pytest

from retrofitter.data import packages, wiki
from retrofitter.data.cache import read_manifest, sha256_file
from retrofitter.data.packages import FetchError
from retrofitter.data.wiki import fetch_wiki, is_eval_title, read_articles, split_articles


def test_dump_parsing_skips_redirects_and_other_namespaces(tmp_path, wiki_dump_writer):
    pages = [{"title": "Kept", "text": "'''Kept''' is an article with [[real|plain]] words."},
             {"title": "Old name", "text": "#REDIRECT [[Kept]]", "redirect": "Kept"},
             {"title": "Talk:Kept", "ns": "1", "text": "A talk page with enough words in it."},
             {"title": "Only markup", "text": "{{stub}}"}]
    articles = read_articles(wiki_dump_writer(tmp_path / "dump.xml.bz2", pages))
    assert [(article.title, article.text) for article in articles] == [("Kept", "Kept is an article with plain words.")]


def test_split_is_deterministic_disjoint_and_local(tmp_path, wiki_dump_writer, pages_factory):
    articles = read_articles(wiki_dump_writer(tmp_path / "dump.xml.bz2", pages_factory(60)))
    first, second = split_articles(articles), split_articles(list(articles))
    assert first == second
    calib_titles = {article.title for article in first["wiki-calib"]}
    eval_titles = {article.title for article in first["wiki-eval"]}
    assert not calib_titles & eval_titles
    assert calib_titles | eval_titles == {article.title for article in articles}
    assert 0.05 < len(eval_titles) / len(articles) < 0.45
    # The rule depends on the title only: a subset of the dump splits the same way.
    subset = split_articles(articles[::3])
    assert {article.title for article in subset["wiki-eval"]} == {a.title for a in articles[::3] if is_eval_title(a.title)}


def _fake_pip(calls, wheel_writer, member, payload):
    def pip_download(name, version, dest, extra_args=(), item=None, progress=False):
        calls.append((name, version))
        return wheel_writer(dest, name, version, {member: payload})
    return pip_download


def test_fetch_wiki_writes_splits_manifest_and_is_idempotent(tmp_path, monkeypatch, isolated_cache, wiki_dump_writer,
                                                             pages_factory, fake_wheel_writer):
    dump = wiki_dump_writer(tmp_path / "dump.bz2", pages_factory(30)).read_bytes()
    calls = []
    monkeypatch.setattr(wiki, "WIKI_SOURCE", dataclasses.replace(wiki.WIKI_SOURCE, sha256=None))
    monkeypatch.setattr(packages, "pip_download", _fake_pip(calls, fake_wheel_writer, wiki.WIKI_SOURCE.member, dump))
    paths = fetch_wiki(progress=False)
    assert calls == [("gensim", "4.4.0")]
    calib, evaluation = paths["wiki-calib"].read_text(), paths["wiki-eval"].read_text()
    calib_titles = [block.splitlines()[0] for block in calib.strip().split("\n\n")]
    eval_titles = [block.splitlines()[0] for block in evaluation.strip().split("\n\n")]
    assert sorted(calib_titles + eval_titles) == sorted(f"Article {index}" for index in range(30))
    manifest = read_manifest("wiki")
    assert manifest["stats"]["wiki-eval"]["articles"] == len(eval_titles)
    assert {record["path"] for record in manifest["files"]} == {"corpora/wiki-calib.txt", "corpora/wiki-eval.txt"}
    mtime = paths["wiki-eval"].stat().st_mtime_ns
    assert fetch_wiki(progress=False) == paths
    assert calls == [("gensim", "4.4.0")] and paths["wiki-eval"].stat().st_mtime_ns == mtime
    assert not any((isolated_cache / "tmp").iterdir())  # scratch space cleaned up


def test_fetch_wiki_checks_the_pinned_checksum(tmp_path, monkeypatch, isolated_cache, wiki_dump_writer,
                                               pages_factory, fake_wheel_writer):
    dump = wiki_dump_writer(tmp_path / "dump.bz2", pages_factory(3)).read_bytes()
    monkeypatch.setattr(packages, "pip_download", _fake_pip([], fake_wheel_writer, wiki.WIKI_SOURCE.member, dump))
    with pytest.raises(FetchError, match=r"fetching wiki from package gensim==4\.4\.0 failed: sha256 of .* expected"):
        fetch_wiki(progress=False)
    assert read_manifest("wiki") is None


def test_fetch_wiki_reports_a_corrupt_dump(monkeypatch, isolated_cache, fake_wheel_writer):
    monkeypatch.setattr(wiki, "WIKI_SOURCE", dataclasses.replace(wiki.WIKI_SOURCE, sha256=None))
    monkeypatch.setattr(packages, "pip_download", _fake_pip([], fake_wheel_writer, wiki.WIKI_SOURCE.member, b"not bz2"))
    with pytest.raises(FetchError, match="fetching wiki from package gensim==4.4.0 failed: cannot parse"):
        fetch_wiki(progress=False)


def test_fetch_wiki_checks_the_pinned_corpus_of_a_known_dump(tmp_path, monkeypatch, isolated_cache, wiki_dump_writer,
                                                             pages_factory, fake_wheel_writer):
    dump = wiki_dump_writer(tmp_path / "dump.bz2", pages_factory(30)).read_bytes()
    monkeypatch.setattr(wiki, "WIKI_SOURCE", dataclasses.replace(wiki.WIKI_SOURCE, sha256=None))
    monkeypatch.setattr(packages, "pip_download", _fake_pip([], fake_wheel_writer, wiki.WIKI_SOURCE.member, dump))
    paths = fetch_wiki(progress=False)  # this dump is not a known one: its corpus is not checked
    dump_sha = read_manifest("wiki")["sources"][0]["sha256"]
    built = {name: sha256_file(path) for name, path in paths.items()}
    monkeypatch.setattr(wiki, "WIKI_TEXT_SHA256", {dump_sha: {**built, "wiki-eval": "0" * 64}})
    with pytest.raises(FetchError, match=f"wiki-eval built from the dump has sha256 {built['wiki-eval']}, "
                                         f"expected {'0' * 64}: the cleaning changed"):
        fetch_wiki(progress=False, force=True)
    assert {name: sha256_file(path) for name, path in paths.items()} == built
    monkeypatch.setattr(wiki, "WIKI_TEXT_SHA256", {dump_sha: built})
    assert fetch_wiki(progress=False, force=True) == paths
