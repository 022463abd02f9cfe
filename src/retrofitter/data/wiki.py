"""Wikipedia prose split into a calibration part and an evaluation part that share no article.

Source: the PyPI wheel ``gensim==4.4.0`` (not installed, only unzipped) ships a real English
Wikipedia dump excerpt as test data (~106 articles after redirects are skipped). Pages are
streamed with ``xml.etree.ElementTree.iterparse`` from the bz2 file; redirects and pages
outside the main namespace are skipped; markup is removed by :func:`clean_wikitext`.
The bytes built from the pinned dump are pinned too (``WIKI_TEXT_SHA256``): every wiki figure
was measured on them, so a fetch that builds anything else from that dump (a cleaner change, a
parser release that behaves differently) fails instead of silently changing the corpus.

Split rule (fixed, independent of the other articles in the dump):
``int(sha1(title), 16) % EVAL_MODULUS == 0`` → evaluation, otherwise calibration (≈ 1/5 eval).
Output files: one article per block, title on its first line, blocks separated by a blank line.
"""

from __future__ import annotations

import bz2
import hashlib
import shutil
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

from . import packages
from .cache import (atomic_write_text, corpora_dir, item_lock, manifest_is_complete, scratch_dir, sha256_bytes,
                    sha256_file, write_manifest)
from .packages import FetchError, WheelMember, report
from .wikitext import clean_wikitext

WIKI_ITEM = "wiki"
WIKI_SOURCE = WheelMember(
    package="gensim",
    version="4.4.0",
    member="gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
    sha256="a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d",
    # gensim wheels are platform specific; pin one so every machine gets the same bytes.
    pip_args=("--platform", "manylinux_2_28_x86_64", "--python-version", "3.11",
              "--implementation", "cp", "--abi", "cp311"),
)
WIKI_SPLITS = ("wiki-calib", "wiki-eval")
EVAL_MODULUS = 5
MAIN_NAMESPACE = "0"
# sha256 of each split, by sha256 of the dump it is built from (other dumps are not checked).
WIKI_TEXT_SHA256 = {
    WIKI_SOURCE.sha256: {"wiki-calib": "8c4ef7dad76f7674448df3d978bd15900c6fd7963504cc3fb9b234c4722a750e",
                         "wiki-eval": "6a58fbb3d67cb1c722fe521e1a9689afa9b599a126d3774855eba69a6eb84fc4"},
}


@dataclass(frozen=True)
class Article:
    title: str
    text: str

    @property
    def word_count(self) -> int:
        return len(self.text.split())


def wiki_paths() -> dict[str, Path]:
    return {name: corpora_dir() / f"{name}.txt" for name in WIKI_SPLITS}


def is_eval_title(title: str) -> bool:
    """The split rule: sha1 of the UTF-8 title, as an integer, divisible by EVAL_MODULUS → eval."""
    return int(hashlib.sha1(title.encode("utf-8")).hexdigest(), 16) % EVAL_MODULUS == 0


def _local_name(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]  # drop the "{http://www.mediawiki.org/xml/export-0.10/}" prefix


def iter_dump_pages(stream: BinaryIO) -> Iterator[tuple[str, str, bool, str]]:
    """Yield (title, namespace, is_redirect, wikitext) per ``<page>`` of a MediaWiki XML dump."""
    for _event, element in ElementTree.iterparse(stream, events=("end",)):
        if _local_name(element.tag) != "page":
            continue
        fields = {"title": "", "ns": "", "text": ""}
        is_redirect = False
        for child in element.iter():
            name = _local_name(child.tag)
            if name in fields and not fields[name]:
                fields[name] = child.text or ""
            is_redirect = is_redirect or name == "redirect"
        is_redirect = is_redirect or fields["text"].lstrip().upper().startswith("#REDIRECT")
        yield fields["title"], fields["ns"], is_redirect, fields["text"]
        element.clear()  # keep memory flat on large dumps


def read_articles(dump_path: str | Path, progress: bool = False) -> list[Article]:
    """Main-namespace, non-redirect articles of a ``.xml.bz2`` (or plain ``.xml``) dump, cleaned."""
    from tqdm.auto import tqdm

    dump_path = Path(dump_path)
    opener = bz2.open if dump_path.suffix == ".bz2" else open
    articles = []
    with opener(dump_path, "rb") as stream:
        pages = tqdm(iter_dump_pages(stream), desc="wiki: parsing pages", unit="page", disable=not progress)
        for title, namespace, is_redirect, wikitext in pages:
            if is_redirect or namespace != MAIN_NAMESPACE:
                continue
            text = clean_wikitext(wikitext)
            if text:
                articles.append(Article(title, text))
    return articles


def split_articles(articles: list[Article]) -> dict[str, list[Article]]:
    """Apply the split rule; dump order is kept within each part."""
    return {"wiki-calib": [article for article in articles if not is_eval_title(article.title)],
            "wiki-eval": [article for article in articles if is_eval_title(article.title)]}


def format_articles(articles: list[Article]) -> str:
    """Title line + text per article, articles separated by one blank line."""
    return "\n\n".join(f"{article.title}\n{article.text}" for article in articles) + "\n"


def fetch_wiki(progress: bool = True, force: bool = False, source: WheelMember | None = None) -> dict[str, Path]:
    """Write ``wiki-calib.txt`` and ``wiki-eval.txt`` into ``cache_dir()/corpora`` unless already there."""
    source = source or WIKI_SOURCE
    targets = wiki_paths()
    with item_lock(WIKI_ITEM):
        if not force and manifest_is_complete(WIKI_ITEM):
            return targets
        started = time.perf_counter()
        scratch = scratch_dir(WIKI_ITEM)
        try:
            dump = packages.fetch_wheel_member(source, scratch, item=WIKI_ITEM, progress=progress)
            dump_sha256 = sha256_file(dump)
            try:
                articles = read_articles(dump, progress=progress)
            except (ElementTree.ParseError, OSError, EOFError) as error:
                raise FetchError(WIKI_ITEM, source.requirement, f"cannot parse {source.member}: {error}") from error
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        parts = split_articles(articles)
        empty = [name for name, part in parts.items() if not part]
        if empty:
            raise FetchError(WIKI_ITEM, source.requirement, f"split(s) {empty} have no article ({len(articles)} in total)")
        texts = {name: format_articles(part) for name, part in parts.items()}
        for name, expected in WIKI_TEXT_SHA256.get(dump_sha256, {}).items():
            actual = sha256_bytes(texts[name].encode("utf-8"))
            if actual != expected:
                raise FetchError(WIKI_ITEM, source.requirement, f"{name} built from the dump has sha256 {actual}, "
                                 f"expected {expected}: the cleaning changed, so would every wiki figure")
        for name, text in texts.items():
            atomic_write_text(targets[name], text)
        stats = {name: {"articles": len(part), "words": sum(article.word_count for article in part)}
                 for name, part in parts.items()}
        stats["split_rule"] = f"int(sha1(title), 16) % {EVAL_MODULUS} == 0 -> wiki-eval"
        stats["seconds"] = round(time.perf_counter() - started, 2)
        sources = [{"kind": "pypi", "package": source.requirement, "member": source.member, "sha256": dump_sha256}]
        write_manifest(WIKI_ITEM, list(targets.values()), sources, stats)
        report(progress, "wiki: " + ", ".join(f"{name} {stats[name]['articles']} articles / {stats[name]['words']:,} words"
                                              for name in WIKI_SPLITS))
        return targets
