"""A small pure-Python reader of R's serialization format (enough for data packages).

R stores a package's data sets in a lazy-load database: ``Rdata.rdx`` is a (gzip- or
zlib-compressed) serialized list ``list(variables = list(<name> = c(offset, length), ...),
references = ..., compressed = ...)`` and ``Rdata.rdb`` holds, at each ``offset``, a record of
``length`` bytes = 4-byte big-endian uncompressed size + zlib stream of one serialized object.

A serialized object ("XDR" format, versions 2 and 3) is::

    "X\\n"  int version  int writer_version  int min_reader_version
    [version 3: int n  n bytes native encoding]
    item

and an item is an int ``flags`` — ``type = flags & 0xFF``, ``levels = flags >> 12``,
``is_object = flags & 0x100``, ``has_attributes = flags & 0x200``, ``has_tag = flags & 0x400`` —
followed by a type-specific payload (lengths are int, or -1 then two ints for long vectors;
integers are big-endian int32 with NA = INT_MIN; doubles are big-endian IEEE 754). Symbols are
appended to a reference table and later items may point back to them with REFSXP
(index = ``flags >> 8``, or the next int when that is 0).

Supported: NILSXP, SYMSXP, LISTSXP (pairlists, attributes, tags), CHARSXP (NA_STRING,
UTF-8 / Latin-1 / bytes encodings), LGLSXP, INTSXP, REALSXP, CPLXSXP, STRSXP, VECSXP,
EXPRSXP, REFSXP and the special environment/missing-value markers. Anything else raises
:class:`RDataError` naming the object being read.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RDataError", "RObject", "RSymbol", "RSpecial", "parse_serialized", "decompress_r",
           "read_lazyload_index", "read_lazyload_object", "read_lazyload_db"]

# SEXP type codes (R's Rinternals.h) and the pseudo-types used only in serialization (serialize.c).
SEXP_NAMES = {0: "NILSXP", 1: "SYMSXP", 2: "LISTSXP", 3: "CLOSXP", 4: "ENVSXP", 5: "PROMSXP",
              6: "LANGSXP", 9: "CHARSXP", 10: "LGLSXP", 13: "INTSXP", 14: "REALSXP", 15: "CPLXSXP",
              16: "STRSXP", 19: "VECSXP", 20: "EXPRSXP", 25: "S4SXP", 238: "ALTREP_SXP",
              254: "NILVALUE_SXP", 255: "REFSXP"}
NILSXP, SYMSXP, LISTSXP, CHARSXP, LGLSXP, INTSXP, REALSXP, CPLXSXP = 0, 1, 2, 9, 10, 13, 14, 15
STRSXP, VECSXP, EXPRSXP = 16, 19, 20
REFSXP, NILVALUE_SXP = 255, 254
# Markers that stand for a unique R object and carry no payload.
SPECIAL_MARKERS = {253: "R_GlobalEnv", 252: "R_UnboundValue", 251: "R_MissingArg", 250: "R_BaseNamespace",
                   242: "R_EmptyEnv", 241: "R_BaseEnv"}
IS_OBJECT_BIT, HAS_ATTRIBUTES_BIT, HAS_TAG_BIT = 1 << 8, 1 << 9, 1 << 10
# CHARSXP encoding flags live in `levels` (R's gp bits).
BYTES_MASK, LATIN1_MASK, UTF8_MASK, ASCII_MASK = 1 << 1, 1 << 2, 1 << 3, 1 << 6
NA_INTEGER = -(2**31)
NA_STRING_LENGTH = -1
SUPPORTED_VERSIONS = (2, 3)


class RDataError(ValueError):
    """Unsupported or malformed R serialization data (the message names the object)."""


@dataclass(frozen=True)
class RSymbol:
    """An R symbol (``as.name("x")``)."""

    name: str


@dataclass(frozen=True)
class RSpecial:
    """A unique R object without payload, e.g. ``R_GlobalEnv`` or ``R_MissingArg``."""

    name: str


@dataclass
class RObject:
    """A deserialized R vector or pairlist.

    ``values``: list of Python values — str/None (NA) for STRSXP, int/None for INTSXP, bool/None
    for LGLSXP, float for REALSXP (NA_real_ is a NaN), complex for CPLXSXP, nested objects for
    VECSXP/EXPRSXP/LISTSXP. ``tags``: element names of a pairlist (None where untagged).
    ``attributes``: name → value (``names``, ``class``, ``dim``...).
    """

    sexptype: str
    values: list[Any]
    attributes: dict[str, Any] = field(default_factory=dict)
    tags: list[str | None] | None = None

    @property
    def names(self) -> list[str | None] | None:
        """The ``names`` attribute, or the tags of a pairlist."""
        if "names" in self.attributes:
            return list(self.attributes["names"].values)
        return list(self.tags) if self.tags is not None else None

    def as_dict(self) -> dict[str, Any]:
        """Named elements as a dict (R's ``x[["name"]]``); raises if the object is unnamed."""
        names = self.names
        if names is None:
            raise RDataError(f"this {self.sexptype} has no names")
        return dict(zip(names, self.values))


class _XdrReader:
    """Reads one serialized item tree from XDR bytes, keeping R's reference table."""

    def __init__(self, data: bytes, context: str):
        self.data, self.pos, self.context = data, 0, context
        self.references: list[Any] = []

    def fail(self, message: str) -> RDataError:
        return RDataError(f"while reading R object {self.context!r} at byte {self.pos}: {message}")

    def take(self, count: int) -> bytes:
        if count < 0 or self.pos + count > len(self.data):
            raise self.fail(f"truncated data (wanted {count} bytes, {len(self.data) - self.pos} left)")
        chunk = self.data[self.pos:self.pos + count]
        self.pos += count
        return chunk

    def int32(self) -> int:
        return struct.unpack(">i", self.take(4))[0]

    def length(self) -> int:
        value = self.int32()
        if value == -1:  # long vector: upper and lower 32 bits follow
            upper, lower = struct.unpack(">II", self.take(8))
            return (upper << 32) | lower
        if value < 0:
            raise self.fail(f"negative vector length {value}")
        return value

    def header(self) -> None:
        magic = self.take(2)
        if magic != b"X\n":
            raise self.fail(f"only the XDR serialization format ('X\\n') is supported, found {magic!r}")
        version, _writer, _min_reader = self.int32(), self.int32(), self.int32()
        if version not in SUPPORTED_VERSIONS:
            raise self.fail(f"serialization version {version} is not supported (only {SUPPORTED_VERSIONS})")
        if version == 3:
            self.take(self.int32())  # native encoding name, e.g. "UTF-8"

    def charsxp(self, levels: int) -> str | None:
        size = self.int32()
        if size == NA_STRING_LENGTH:
            return None
        raw = self.take(size)
        if levels & LATIN1_MASK:
            return raw.decode("latin-1")
        if levels & BYTES_MASK:
            return raw.decode("utf-8", errors="surrogateescape")
        # UTF-8, ASCII or native: the data we read is written on UTF-8 systems.
        return raw.decode("utf-8", errors="replace")

    def item(self) -> Any:
        flags = self.int32()
        sexptype, levels = flags & 0xFF, flags >> 12
        has_attributes, has_tag = bool(flags & HAS_ATTRIBUTES_BIT), bool(flags & HAS_TAG_BIT)
        if sexptype in (NILVALUE_SXP, NILSXP):
            return None
        if sexptype in SPECIAL_MARKERS:
            return RSpecial(SPECIAL_MARKERS[sexptype])
        if sexptype == REFSXP:
            index = flags >> 8 or self.int32()
            if not 1 <= index <= len(self.references):
                raise self.fail(f"REFSXP index {index} outside the reference table (size {len(self.references)})")
            return self.references[index - 1]
        if sexptype == SYMSXP:
            name = self.item()  # a CHARSXP
            symbol = RSymbol(name if name is not None else "NA")
            self.references.append(symbol)
            return symbol
        if sexptype == LISTSXP:
            return self.pairlist(flags)
        if sexptype == CHARSXP:
            value = self.charsxp(levels)
            if has_attributes:  # old writers stored an attribute on CHARSXPs; R ignores it
                self.item()
            return value
        reader = _VECTOR_READERS.get(sexptype)
        if reader is None:
            name = SEXP_NAMES.get(sexptype, "unknown")
            raise self.fail(f"unsupported SEXP type {sexptype} ({name})")
        values = reader(self, self.length())
        attributes = self.attributes() if has_attributes else {}
        return RObject(SEXP_NAMES[sexptype], values, attributes)

    def attributes(self) -> dict[str, Any]:
        pairs = self.item()
        if not isinstance(pairs, RObject) or pairs.sexptype != "LISTSXP":
            raise self.fail(f"attributes must be a pairlist, got {type(pairs).__name__}")
        return {tag: value for tag, value in zip(pairs.tags or [], pairs.values)}

    def pairlist(self, flags: int) -> RObject:
        # Walk the CDR chain iteratively: long pairlists would overflow Python's recursion limit.
        values: list[Any] = []
        tags: list[str | None] = []
        attributes: dict[str, Any] = {}
        while True:
            if flags & HAS_ATTRIBUTES_BIT:
                cell_attributes = self.attributes()
                if not values:
                    attributes = cell_attributes
            tag = self.item() if flags & HAS_TAG_BIT else None
            tags.append(tag.name if isinstance(tag, RSymbol) else tag)
            values.append(self.item())
            flags = self.int32()
            if flags & 0xFF in (NILVALUE_SXP, NILSXP):
                return RObject("LISTSXP", values, attributes, tags)
            if flags & 0xFF != LISTSXP:
                raise self.fail(f"pairlist CDR of type {flags & 0xFF} ({SEXP_NAMES.get(flags & 0xFF, 'unknown')})"
                                " is not supported")


def _read_logicals(reader: _XdrReader, count: int) -> list[bool | None]:
    raw = struct.unpack(f">{count}i", reader.take(4 * count))
    return [None if value == NA_INTEGER else bool(value) for value in raw]


def _read_integers(reader: _XdrReader, count: int) -> list[int | None]:
    raw = struct.unpack(f">{count}i", reader.take(4 * count))
    return [None if value == NA_INTEGER else value for value in raw]


def _read_doubles(reader: _XdrReader, count: int) -> list[float]:
    return list(struct.unpack(f">{count}d", reader.take(8 * count)))


def _read_complex(reader: _XdrReader, count: int) -> list[complex]:
    raw = struct.unpack(f">{2 * count}d", reader.take(16 * count))
    return [complex(raw[2 * i], raw[2 * i + 1]) for i in range(count)]


def _read_strings(reader: _XdrReader, count: int) -> list[str | None]:
    values = []
    for _ in range(count):
        flags = reader.int32()
        if flags & 0xFF != CHARSXP:
            raise reader.fail(f"STRSXP element of type {flags & 0xFF}, expected CHARSXP (9)")
        values.append(reader.charsxp(flags >> 12))
    return values


def _read_items(reader: _XdrReader, count: int) -> list[Any]:
    return [reader.item() for _ in range(count)]


# Payload readers per vector type: count → list of values.
_VECTOR_READERS = {LGLSXP: _read_logicals, INTSXP: _read_integers, REALSXP: _read_doubles,
                   CPLXSXP: _read_complex, STRSXP: _read_strings, VECSXP: _read_items, EXPRSXP: _read_items}


def decompress_r(data: bytes, context: str = "<data>") -> bytes:
    """Undo the compression R puts around serialized data: gzip (saveRDS), zlib, or none."""
    if data[:2] == b"\x1f\x8b":
        return gzip.decompress(data)
    if data[:2] == b"X\n":
        return data
    try:
        return zlib.decompress(data)
    except zlib.error as error:
        raise RDataError(f"while reading R object {context!r}: neither gzip, zlib nor raw XDR ({error})") from error


def parse_serialized(data: bytes, context: str = "<data>") -> Any:
    """Deserialize one R object from uncompressed XDR bytes (``serialize(x, NULL)`` output)."""
    reader = _XdrReader(data, context)
    reader.header()
    return reader.item()


def read_lazyload_index(rdx_path: str | Path) -> dict[str, tuple[int, int]]:
    """Map object name → (offset, length) of its record in the ``.rdb`` file."""
    rdx_path = Path(rdx_path)
    index = parse_serialized(decompress_r(rdx_path.read_bytes(), rdx_path.name), rdx_path.name)
    if not isinstance(index, RObject) or "variables" not in (index.names or []):
        raise RDataError(f"{rdx_path.name} is not a lazy-load index (no 'variables' element)")
    variables = index.as_dict()["variables"]
    positions = {}
    for name, location in variables.as_dict().items():
        if not isinstance(location, RObject) or len(location.values) != 2:
            raise RDataError(f"{rdx_path.name}: entry {name!r} is not c(offset, length)")
        positions[name] = (int(location.values[0]), int(location.values[1]))
    return positions


_TYPED_DECOMPRESSORS = {b"0": bytes, b"1": zlib.decompress, b"2": bz2.decompress, b"Z": lzma.decompress}


def read_lazyload_object(rdb_bytes: bytes, offset: int, length: int, name: str) -> Any:
    """Read one object from the ``.rdb`` bytes: 4-byte big-endian size + zlib(serialized object)."""
    record = rdb_bytes[offset:offset + length]
    if len(record) != length or length < 5:
        raise RDataError(f"while reading R object {name!r}: record [{offset}, {offset + length}) is outside the .rdb")
    expected_size = struct.unpack(">I", record[:4])[0]
    try:
        payload = zlib.decompress(record[4:])
    except zlib.error:
        # compress = 2 or 3 databases put a type byte after the size: '0' none, '1' zlib, '2' bzip2, 'Z' xz.
        decoder = _TYPED_DECOMPRESSORS.get(record[4:5])
        if decoder is None:
            raise RDataError(f"while reading R object {name!r}: record is neither zlib data nor a typed "
                             f"record (type byte {record[4:5]!r})") from None
        payload = decoder(record[5:])
    if len(payload) != expected_size:
        raise RDataError(f"while reading R object {name!r}: {len(payload)} bytes, header says {expected_size}")
    return parse_serialized(payload, name)


def read_lazyload_db(base: str | Path, names: list[str] | None = None) -> dict[str, Any]:
    """Read objects from ``<base>.rdb``/``<base>.rdx`` (e.g. ``.../data/Rdata``); all when ``names`` is None."""
    base = Path(base)
    positions = read_lazyload_index(base.with_suffix(".rdx"))
    wanted = list(positions) if names is None else names
    missing = [name for name in wanted if name not in positions]
    if missing:
        raise RDataError(f"{base.name}.rdx has no object(s) {missing}; it has {sorted(positions)}")
    rdb_bytes = base.with_suffix(".rdb").read_bytes()
    return {name: read_lazyload_object(rdb_bytes, *positions[name], name) for name in wanted}
