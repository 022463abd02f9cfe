"""Jane Austen's six novels as a plain-text corpus (a second domain for evaluation).

Source: the Debian package ``r-cran-janeaustenr`` (the R package janeaustenr, Project
Gutenberg texts). Each novel is a character vector of lines inside the package's lazy-load
data base ``janeaustenr/data/Rdata.rdb``; :mod:`retrofitter.data.rdata` reads it without R.
Lines are joined into paragraphs (a blank line ends a paragraph), paragraphs are separated by
one blank line, novels by one blank line too, in publication order.

The text built from a known ``Rdata.rdb`` is pinned by its sha256 (``AUSTEN_TEXT_SHA256``): every
Austen figure was measured on it, so a reader change that alters it fails the fetch instead of
silently changing the corpus.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import Any

from . import packages
from .cache import atomic_write_text, corpora_dir, item_lock, manifest_is_complete, scratch_dir, sha256_bytes, write_manifest
from .packages import FetchError, report
from .rdata import RDataError, character_vector, read_lazyload_db

AUSTEN_ITEM = "austen"
AUSTEN_PACKAGE = "r-cran-janeaustenr"
# Path of the lazy-load data base inside the unpacked .deb (without .rdb/.rdx).
AUSTEN_DB_RELATIVE = "usr/lib/R/site-library/janeaustenr/data/Rdata"
# Publication order.
AUSTEN_NOVELS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")
# sha256 of austen.txt, by sha256 of the Rdata.rdb it is read from (r-cran-janeaustenr 1.0.0-1).
AUSTEN_TEXT_SHA256 = {
    "8fb5198960d0da724b1562f96e4221e5c1b41ff455000280b02c55980c3d8f21":
        "bf5c1d6389871025b6e18e1aaa699065619552e08c41934e020f4406d0c8debe",
}
# Gutenberg marks italics as _word_; the underscores are typography, not text.
_ITALIC_MARK = re.compile(r"_")
_SPACES = re.compile(r"\s+")


def austen_path() -> Path:
    return corpora_dir() / "austen.txt"


def lines_to_paragraphs(lines: list[str | None]) -> list[str]:
    """Join consecutive non-blank lines with single spaces; blank (or NA) lines end a paragraph."""
    paragraphs, current = [], []
    for line in lines:
        stripped = _SPACES.sub(" ", _ITALIC_MARK.sub("", line or "")).strip()
        if stripped:
            current.append(stripped)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return paragraphs


def novels_to_text(novels: dict[str, Any]) -> tuple[str, dict[str, int]]:
    """Text of the novels (character vectors of lines) in AUSTEN_NOVELS order and the word count of each."""
    blocks, word_counts = [], {}
    for name in AUSTEN_NOVELS:
        block = "\n\n".join(lines_to_paragraphs(character_vector(novels[name], name)))
        word_counts[name] = len(block.split())
        blocks.append(block)
    return "\n\n".join(blocks) + "\n", word_counts


def fetch_austen(progress: bool = True, force: bool = False) -> Path:
    """Write ``cache_dir()/corpora/austen.txt`` (about 720k words) unless already fetched; returns its path."""
    target = austen_path()
    with item_lock(AUSTEN_ITEM):
        if not force and manifest_is_complete(AUSTEN_ITEM):
            return target
        started = time.perf_counter()
        scratch = scratch_dir(AUSTEN_ITEM)
        try:
            root = packages.apt_download(AUSTEN_PACKAGE, scratch, item=AUSTEN_ITEM, progress=progress)
            database = root / AUSTEN_DB_RELATIVE
            if not database.with_suffix(".rdb").is_file():
                raise FetchError(AUSTEN_ITEM, AUSTEN_PACKAGE, f"the package has no {AUSTEN_DB_RELATIVE}.rdb")
            try:
                novels = read_lazyload_db(database, list(AUSTEN_NOVELS))
                text, word_counts = novels_to_text(novels)
            except RDataError as error:
                raise FetchError(AUSTEN_ITEM, AUSTEN_PACKAGE, str(error)) from error
            source_sha = {suffix: sha256_bytes(database.with_suffix(suffix).read_bytes()) for suffix in (".rdb", ".rdx")}
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        expected, actual = AUSTEN_TEXT_SHA256.get(source_sha[".rdb"]), sha256_bytes(text.encode("utf-8"))
        if expected is not None and actual != expected:
            raise FetchError(AUSTEN_ITEM, AUSTEN_PACKAGE, f"the text built from Rdata.rdb {source_sha['.rdb']} has "
                             f"sha256 {actual}, expected {expected}: the reader changed, so would every Austen figure")
        atomic_write_text(target, text)
        stats = {"novels": word_counts, "words": sum(word_counts.values()),
                 "paragraphs": text.count("\n\n") + 1, "seconds": round(time.perf_counter() - started, 2)}
        sources = [{"kind": "debian", "package": AUSTEN_PACKAGE, "member": AUSTEN_DB_RELATIVE + ".rdb/.rdx",
                    "sha256": source_sha}]
        write_manifest(AUSTEN_ITEM, [target], sources, stats)
        report(progress, f"austen: {stats['words']:,} words in {len(AUSTEN_NOVELS)} novels -> {target}")
        return target
