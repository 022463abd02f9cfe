"""The pure-Python R serialization reader on hand-written XDR bytes."""

from __future__ import annotations

import math
import struct
import zlib

import pytest

from retrofitter.data.rdata import (RDataError, RObject, RSymbol, parse_serialized, read_lazyload_db,
                                    read_lazyload_index, read_lazyload_object)


def test_strsxp_with_na_and_latin1(xdr):
    data = xdr.header() + xdr.flags(16) + struct.pack(">i", 3) + xdr.charsxp("Emma") + xdr.charsxp(None) \
        + xdr.charsxp("café", levels=1 << 2, encoding="latin-1")
    value = parse_serialized(data)
    assert isinstance(value, RObject) and value.sexptype == "STRSXP"
    assert value.values == ["Emma", None, "café"]


def test_named_vecsxp_and_refsxp_reuse_the_symbol(xdr):
    # list(a = c(7L, NA), b = list(x = "s")). A VECSXP's attributes follow its elements, so in stream
    # order the inner list's "names" is the first SYMSXP (reference 1); the outer names point back to it.
    inner = xdr.vecsxp([xdr.strsxp(["s"])], xdr.names_attribute(["x"], xdr.symsxp("names")))
    outer = xdr.vecsxp([xdr.intsxp([7, None]), inner], xdr.names_attribute(["a", "b"], xdr.ref(1)))
    value = parse_serialized(xdr.header() + outer)
    assert value.names == ["a", "b"]
    named = value.as_dict()
    assert named["a"].values == [7, None]
    assert named["b"].as_dict()["x"].values == ["s"]


def test_pairlist_tags_reals_logicals_and_version_2(xdr):
    cells = [(xdr.symsxp("pi"), xdr.realsxp([math.pi, float("inf")])),
             (xdr.symsxp("flags"), xdr.lglsxp([True, False, None])),
             (None, xdr.nil()),
             (xdr.ref(1), xdr.symsxp("z"))]
    value = parse_serialized(xdr.header(version=2) + xdr.pairlist(cells))
    assert value.sexptype == "LISTSXP"
    assert value.tags == ["pi", "flags", None, "pi"]
    assert value.values[0].values == [math.pi, float("inf")]
    assert value.values[1].values == [True, False, None]
    assert value.values[2] is None
    assert value.values[3] == RSymbol("z")


def test_unsupported_type_names_the_object(xdr):
    environment = xdr.flags(4) + b"\x00" * 16  # ENVSXP
    with pytest.raises(RDataError, match=r"'emma'.*unsupported SEXP type 4 \(ENVSXP\)"):
        parse_serialized(xdr.header() + environment, context="emma")


def test_bad_reference_and_truncation_and_format(xdr):
    with pytest.raises(RDataError, match="REFSXP index 3 outside the reference table"):
        parse_serialized(xdr.header() + xdr.ref(3), context="obj")
    with pytest.raises(RDataError, match="truncated"):
        parse_serialized((xdr.header() + xdr.strsxp(["abcdef"]))[:-3], context="obj")
    with pytest.raises(RDataError, match="only the XDR"):
        parse_serialized(b"A\n1\n", context="obj")
    with pytest.raises(RDataError, match="version 4"):
        parse_serialized(b"X\n" + struct.pack(">iii", 4, 0, 0), context="obj")


def test_lazyload_database_roundtrip(tmp_path, lazyload_db_writer):
    novels = {"emma": ["EMMA", "", "Emma Woodhouse, handsome,", None, "clever"], "persuasion": ["Sir Walter"]}
    base = lazyload_db_writer(tmp_path / "data" / "Rdata", novels)
    index = read_lazyload_index(base.with_suffix(".rdx"))
    assert sorted(index) == ["emma", "persuasion"]
    objects = read_lazyload_db(base)
    assert {name: value.values for name, value in objects.items()} == novels
    with pytest.raises(RDataError, match=r"no object\(s\) \['mansfieldpark'\]"):
        read_lazyload_db(base, ["mansfieldpark"])


def test_lazyload_record_checks_size_and_compression(xdr):
    payload = xdr.header() + xdr.strsxp(["x"])
    record = struct.pack(">I", len(payload) + 1) + zlib.compress(payload)
    with pytest.raises(RDataError, match="'obj'.*header says"):
        read_lazyload_object(record, 0, len(record), "obj")
    with pytest.raises(RDataError, match="outside the .rdb"):
        read_lazyload_object(record, 10, len(record), "obj")
