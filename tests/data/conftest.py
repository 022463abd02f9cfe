"""Fixtures for retrofitter.data tests: an isolated cache, an R XDR writer, synthetic dumps and packages."""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zipfile
import zlib
from pathlib import Path
from xml.sax.saxutils import escape

import pytest

UTF8_LEVELS = 1 << 3
LATIN1_LEVELS = 1 << 2


class Xdr:
    """Writes R's XDR serialization by hand (big-endian ints/doubles), mirroring R's serialize.c."""

    @staticmethod
    def header(version: int = 3) -> bytes:
        data = b"X\n" + struct.pack(">iii", version, 0x040201, 0x030500)
        return data + (struct.pack(">i", 5) + b"UTF-8" if version == 3 else b"")

    @staticmethod
    def flags(sexptype: int, levels: int = 0, has_attributes: bool = False, has_tag: bool = False) -> bytes:
        return struct.pack(">i", sexptype | (levels << 12) | (has_attributes << 9) | (has_tag << 10))

    @classmethod
    def charsxp(cls, value: str | None, levels: int = UTF8_LEVELS, encoding: str = "utf-8") -> bytes:
        if value is None:  # NA_STRING
            return cls.flags(9) + struct.pack(">i", -1)
        raw = value.encode(encoding)
        return cls.flags(9, levels) + struct.pack(">i", len(raw)) + raw

    @classmethod
    def strsxp(cls, values: list[str | None], attributes: bytes | None = None) -> bytes:
        body = b"".join(cls.charsxp(value) for value in values)
        return cls.flags(16, has_attributes=attributes is not None) + struct.pack(">i", len(values)) + body + (attributes or b"")

    @classmethod
    def intsxp(cls, values: list[int | None], attributes: bytes | None = None) -> bytes:
        raw = [-(2**31) if value is None else value for value in values]
        return (cls.flags(13, has_attributes=attributes is not None) + struct.pack(f">i{len(raw)}i", len(raw), *raw)
                + (attributes or b""))

    @classmethod
    def realsxp(cls, values: list[float]) -> bytes:
        return cls.flags(14) + struct.pack(f">i{len(values)}d", len(values), *values)

    @classmethod
    def lglsxp(cls, values: list[bool | None]) -> bytes:
        raw = [-(2**31) if value is None else int(value) for value in values]
        return cls.flags(10) + struct.pack(f">i{len(raw)}i", len(raw), *raw)

    @classmethod
    def vecsxp(cls, items: list[bytes], attributes: bytes | None = None) -> bytes:
        return cls.flags(19, has_attributes=attributes is not None) + struct.pack(">i", len(items)) + b"".join(items) + (attributes or b"")

    @classmethod
    def symsxp(cls, name: str) -> bytes:
        return cls.flags(1) + cls.charsxp(name)

    @staticmethod
    def ref(index: int) -> bytes:
        return struct.pack(">i", (index << 8) | 255)

    @staticmethod
    def nil() -> bytes:
        return struct.pack(">i", 254)

    @classmethod
    def pairlist(cls, cells: list[tuple[bytes | None, bytes]]) -> bytes:
        """cells: (serialized tag symbol or None, serialized value); ends with R_NilValue."""
        out = b""
        for tag, value in cells:
            out += cls.flags(2, has_tag=tag is not None) + (tag or b"") + value
        return out + cls.nil()

    @classmethod
    def names_attribute(cls, names: list[str], names_symbol: bytes) -> bytes:
        return cls.pairlist([(names_symbol, cls.strsxp(names))])


def lazyload_record(payload: bytes, codec: bytes | None = None) -> bytes:
    """One .rdb record: 4-byte big-endian size, then zlib (codec None) or a type byte and that codec's stream."""
    compressors = {b"0": bytes, b"1": zlib.compress, b"2": bz2.compress, b"Z": lzma.compress}
    body = zlib.compress(payload) if codec is None else codec + compressors[codec](payload)
    return struct.pack(">I", len(payload)) + body


def write_lazyload_db(base: Path, objects: dict[str, list[str | None]], codec: bytes | None = None) -> Path:
    """Write ``base``.rdb/.rdx holding character vectors, laid out like R's makeLazyLoadDB.

    ``codec`` None: ``compressed = TRUE`` (zlib records); else ``compressed = 3`` and that type byte.
    """
    base.parent.mkdir(parents=True, exist_ok=True)
    rdb, positions = b"", {}
    for name, lines in objects.items():
        record = lazyload_record(Xdr.header() + Xdr.strsxp(lines), codec)
        positions[name] = (len(rdb), len(record))
        rdb += record
    # The first "names" is a SYMSXP (reference 1), later ones point back to it with REFSXP.
    variables = Xdr.vecsxp([Xdr.intsxp(list(position)) for position in positions.values()],
                           Xdr.names_attribute(list(positions), Xdr.symsxp("names")))
    compressed = Xdr.lglsxp([True]) if codec is None else Xdr.realsxp([3.0])
    index = Xdr.vecsxp([variables, Xdr.vecsxp([]), compressed],
                       Xdr.names_attribute(["variables", "references", "compressed"], Xdr.ref(1)))
    base.with_suffix(".rdb").write_bytes(rdb)
    base.with_suffix(".rdx").write_bytes(gzip.compress(Xdr.header() + index))
    return base


def write_wiki_dump(path: Path, pages: list[dict]) -> Path:
    """A bz2 MediaWiki XML dump; each page: title, text, optional ns (default "0") and redirect."""
    body = []
    for page in pages:
        redirect = f'<redirect title="{escape(page["redirect"])}" />' if page.get("redirect") else ""
        body.append(f"<page><title>{escape(page['title'])}</title><ns>{page.get('ns', '0')}</ns><id>1</id>{redirect}"
                    f"<revision><id>2</id><text xml:space=\"preserve\">{escape(page['text'])}</text></revision></page>")
    xml = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10">'
           "<siteinfo><sitename>Test</sitename></siteinfo>" + "".join(body) + "</mediawiki>")
    path.write_bytes(bz2.compress(xml.encode("utf-8")))
    return path


def synthetic_pages(count: int) -> list[dict]:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    return [{"title": f"Article {index}",
             "text": f"'''Article {index}''' is about {words[index % 10]}. " + " ".join(words[: 3 + index % 7]) + "."}
            for index in range(count)]


def write_fake_wheel(dest: Path, name: str, version: str, members: dict[str, bytes]) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for member, data in members.items():
            archive.writestr(member, data)
    return wheel


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """RETROFITTER_CACHE pointing at a fresh temporary directory."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("RETROFITTER_CACHE", str(cache))
    return cache


@pytest.fixture
def xdr():
    return Xdr


@pytest.fixture
def lazyload_db_writer():
    return write_lazyload_db


@pytest.fixture
def lazyload_record_writer():
    return lazyload_record


@pytest.fixture
def wiki_dump_writer():
    return write_wiki_dump


@pytest.fixture
def pages_factory():
    return synthetic_pages


@pytest.fixture
def fake_wheel_writer():
    return write_fake_wheel
