"""Objects of an R package's lazy-load database (``data/Rdata.rdx`` + ``data/Rdata.rdb``).

R's serialization format is read by the ``rdata`` package; only the lazy-load framing is ours
(R's ``makeLazyLoadDB`` writes it, ``lazyLoadDBfetch`` reads it):

* ``<base>.rdx`` is one serialized R object (written by ``saveRDS``, so gzip-compressed)::

      list(variables = list(<name> = c(offset, length), ...), references = list(...),
           compressed = TRUE | 2 | 3)

* ``<base>.rdb`` holds, for each variable, ``length`` bytes at ``offset``: a 4-byte big-endian
  size of the serialized object, then the object compressed. With ``compressed = TRUE`` that is
  a zlib stream; with ``2`` or ``3`` one type byte comes first (``'0'`` stored, ``'1'`` zlib,
  ``'2'`` bzip2, ``'Z'`` xz) and the stream follows.

Objects come back as ``rdata.conversion.convert`` makes them (a character vector is a 1-d
numpy array of ``str``, with ``None`` for ``NA``); :func:`character_vector` turns one into a list.
"""

from __future__ import annotations

import bz2
import lzma
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

__all__ = ["RDataError", "LazyLoadIndex", "parse_serialized", "read_lazyload_index", "read_lazyload_record",
           "read_lazyload_object", "read_lazyload_db", "character_vector"]

# R's serialize.c: zlib only when compressed is TRUE; a type byte names the codec when it is 2 or 3.
ZLIB_ONLY = 1
TYPED_COMPRESSION = (2, 3)
TYPE_DECOMPRESSORS: dict[bytes, Callable[[bytes], bytes]] = {
    b"0": bytes, b"1": zlib.decompress, b"2": bz2.decompress, b"Z": lzma.decompress}
SIZE_HEADER = struct.Struct(">I")
# What rdata and the decompressors raise on malformed input (rdata has no exception class of its own).
_MALFORMED = (ValueError, LookupError, TypeError, NotImplementedError, AssertionError, EOFError, OSError,
              zlib.error, lzma.LZMAError)


class RDataError(ValueError):
    """Unsupported or malformed R data (the message names the object)."""


@dataclass(frozen=True)
class LazyLoadIndex:
    """The ``.rdx`` contents that locate objects: name → (offset, length) in the ``.rdb``, and the codec."""

    variables: dict[str, tuple[int, int]]
    compressed: int


def parse_serialized(data: bytes, context: str = "<data>") -> Any:
    """Deserialize one R object (XDR ``serialize()`` output, raw or gzip/bzip2/xz) into Python values."""
    import rdata  # imports pandas and xarray (about a second): only when an R object is read

    try:
        parsed = rdata.parser.parse_data(data, extension=".rds")
        # Version-2 streams do not record the native encoding; the data we read was written as UTF-8.
        return rdata.conversion.convert(parsed, default_encoding="utf_8")
    except _MALFORMED as error:
        raise RDataError(f"while reading R object {context!r}: {type(error).__name__}: {error}") from error


def read_lazyload_index(rdx_path: str | Path) -> LazyLoadIndex:
    """Read ``<base>.rdx``: where each object lies in the ``.rdb`` and how records are compressed."""
    rdx_path = Path(rdx_path)
    index = parse_serialized(rdx_path.read_bytes(), rdx_path.name)
    if not isinstance(index, dict) or not isinstance(index.get("variables"), dict) or "compressed" not in index:
        raise RDataError(f"{rdx_path.name} is not a lazy-load index (no 'variables' and 'compressed' elements)")
    variables = {}
    for name, location in index["variables"].items():
        name = str(name)  # rdata gives numpy strings
        if np.shape(location) != (2,):
            raise RDataError(f"{rdx_path.name}: entry {name!r} is not c(offset, length)")
        variables[name] = (int(location[0]), int(location[1]))
    return LazyLoadIndex(variables, int(np.ravel(index["compressed"])[0]))


def read_lazyload_record(rdb_bytes: bytes, offset: int, length: int, compressed: int, name: str) -> bytes:
    """The serialized bytes of one object: its ``.rdb`` record decompressed, size header checked."""
    record = rdb_bytes[offset:offset + length]
    if len(record) != length or length <= SIZE_HEADER.size:
        raise RDataError(f"while reading R object {name!r}: record [{offset}, {offset + length}) is outside the .rdb")
    expected_size, body = SIZE_HEADER.unpack_from(record)[0], record[SIZE_HEADER.size:]
    if compressed == ZLIB_ONLY:
        decompress = zlib.decompress
    elif compressed in TYPED_COMPRESSION and body[:1] in TYPE_DECOMPRESSORS:
        decompress, body = TYPE_DECOMPRESSORS[body[:1]], body[1:]
    else:
        raise RDataError(f"while reading R object {name!r}: unsupported compression {compressed} "
                         f"(record type byte {body[:1]!r})")
    try:
        payload = decompress(body)
    except _MALFORMED as error:
        raise RDataError(f"while reading R object {name!r}: cannot decompress its record ({error})") from error
    if len(payload) != expected_size:
        raise RDataError(f"while reading R object {name!r}: {len(payload)} bytes, header says {expected_size}")
    return payload


def read_lazyload_object(rdb_bytes: bytes, offset: int, length: int, compressed: int, name: str) -> Any:
    """One object of the ``.rdb`` as Python values (see :func:`parse_serialized`)."""
    return parse_serialized(read_lazyload_record(rdb_bytes, offset, length, compressed, name), name)


def read_lazyload_db(base: str | Path, names: list[str] | None = None) -> dict[str, Any]:
    """Read objects from ``<base>.rdb``/``<base>.rdx`` (e.g. ``.../data/Rdata``); all when ``names`` is None."""
    base = Path(base)
    index = read_lazyload_index(base.with_suffix(".rdx"))
    wanted = list(index.variables) if names is None else names
    missing = [name for name in wanted if name not in index.variables]
    if missing:
        raise RDataError(f"{base.name}.rdx has no object(s) {missing}; it has {sorted(index.variables)}")
    rdb_bytes = base.with_suffix(".rdb").read_bytes()
    return {name: read_lazyload_object(rdb_bytes, *index.variables[name], index.compressed, name) for name in wanted}


def character_vector(value: Any, name: str) -> list[str | None]:
    """``value`` as a list of strings (``None`` for ``NA``); RDataError unless it is an R character vector."""
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "UO":
        items = value.tolist()
        if all(item is None or isinstance(item, str) for item in items):
            return items
    found = f"{value.dtype} array" if isinstance(value, np.ndarray) else type(value).__name__
    raise RDataError(f"R object {name!r} should be a character vector, found {found}")
