"""The lazy-load framing (.rdx index -> offsets in .rdb -> compressed records) around the rdata parser.

Payloads are written by the hand-made XDR writer in conftest (it mirrors R's serialize.c), so
the parser is checked on bytes it did not produce itself.
"""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from retrofitter.data.rdata import (RDataError, character_vector, parse_serialized, read_lazyload_db,
                                    read_lazyload_index, read_lazyload_object, read_lazyload_record)

NOVELS = {"emma": ["EMMA", "", "Emma Woodhouse, handsome,", None, "clever"], "persuasion": ["Sir Walter", "café"]}


def _values(objects):
    return {name: character_vector(value, name) for name, value in objects.items()}


def test_index_maps_names_to_consecutive_records(tmp_path, lazyload_db_writer):
    base = lazyload_db_writer(tmp_path / "data" / "Rdata", NOVELS)
    index = read_lazyload_index(base.with_suffix(".rdx"))
    assert index.compressed == 1
    (emma_offset, emma_length), (persuasion_offset, persuasion_length) = index.variables.values()
    assert list(index.variables) == ["emma", "persuasion"]
    assert emma_offset == 0 and persuasion_offset == emma_length
    assert persuasion_offset + persuasion_length == base.with_suffix(".rdb").stat().st_size


@pytest.mark.parametrize("codec", [None, b"0", b"1", b"2", b"Z"])
def test_database_roundtrip_for_each_record_codec(tmp_path, lazyload_db_writer, codec):
    base = lazyload_db_writer(tmp_path / "Rdata", NOVELS, codec=codec)
    assert read_lazyload_index(base.with_suffix(".rdx")).compressed == (1 if codec is None else 3)
    assert _values(read_lazyload_db(base)) == NOVELS
    assert _values(read_lazyload_db(base, ["persuasion"])) == {"persuasion": NOVELS["persuasion"]}
    with pytest.raises(RDataError, match=r"no object\(s\) \['mansfieldpark'\]; it has \['emma', 'persuasion'\]"):
        read_lazyload_db(base, ["mansfieldpark"])


def test_record_is_checked_against_its_size_header(xdr, lazyload_record_writer):
    payload = xdr.header() + xdr.strsxp(["x"])
    record = lazyload_record_writer(payload)
    assert read_lazyload_record(b"pad" + record, 3, len(record), 1, "obj") == payload
    assert read_lazyload_object(record, 0, len(record), 1, "obj").tolist() == ["x"]
    short = record[:3] + bytes([record[3] + 1]) + record[4:]  # header says one byte more
    with pytest.raises(RDataError, match=r"'obj'.*\d+ bytes, header says \d+"):
        read_lazyload_record(short, 0, len(short), 1, "obj")
    with pytest.raises(RDataError, match=r"'obj'.*outside the \.rdb"):
        read_lazyload_record(record, 10, len(record), 1, "obj")
    with pytest.raises(RDataError, match="'obj': cannot decompress"):
        read_lazyload_record(record[:-4], 0, len(record) - 4, 1, "obj")


def test_record_codec_must_match_the_index(xdr, lazyload_record_writer):
    payload = xdr.header() + xdr.strsxp(["x"])
    typed = lazyload_record_writer(payload, b"2")
    assert read_lazyload_record(typed, 0, len(typed), 2, "obj") == payload
    with pytest.raises(RDataError, match="'obj': cannot decompress"):  # a type byte where zlib is due
        read_lazyload_record(typed, 0, len(typed), 1, "obj")
    unknown = typed[:4] + b"7" + typed[5:]
    with pytest.raises(RDataError, match=r"unsupported compression 3 \(record type byte b'7'\)"):
        read_lazyload_record(unknown, 0, len(unknown), 3, "obj")


def test_index_must_be_a_lazyload_index(tmp_path, xdr):
    rdx = tmp_path / "Rdata.rdx"
    rdx.write_bytes(gzip.compress(xdr.header() + xdr.strsxp(["not", "an", "index"])))
    with pytest.raises(RDataError, match="Rdata.rdx is not a lazy-load index"):
        read_lazyload_index(rdx)
    variables = xdr.vecsxp([xdr.intsxp([0, 10, 20])], xdr.names_attribute(["emma"], xdr.symsxp("names")))
    index = xdr.vecsxp([variables, xdr.lglsxp([True])], xdr.names_attribute(["variables", "compressed"], xdr.ref(1)))
    rdx.write_bytes(gzip.compress(xdr.header() + index))
    with pytest.raises(RDataError, match=r"entry 'emma' is not c\(offset, length\)"):
        read_lazyload_index(rdx)


def test_malformed_serialization_names_the_object(xdr):
    with pytest.raises(RDataError, match="while reading R object 'emma': NotImplementedError: .*version 4"):
        parse_serialized(b"X\n" + b"\x00\x00\x00\x04" + bytes(8), context="emma")
    with pytest.raises(RDataError, match="while reading R object 'emma'"):
        parse_serialized(xdr.header() + xdr.flags(4), context="emma")  # an environment with no payload


def test_character_vector_accepts_only_character_vectors():
    assert character_vector(np.array(["a", None], dtype=object), "x") == ["a", None]
    with pytest.raises(RDataError, match=r"R object 'x' should be a character vector, found int32 array"):
        character_vector(np.array([1, 2], dtype=np.int32), "x")
    with pytest.raises(RDataError, match="found dict"):
        character_vector({"a": 1}, "x")
