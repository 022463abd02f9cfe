"""Flag parsing shared by the commands: comma lists, and flags generated from config dataclass fields."""

from __future__ import annotations

import argparse
import dataclasses

from ..config import COMPRESS_METHODS, CompressConfig

__all__ = ["name_list", "int_list", "positive_int_list", "fraction_list", "add_config_flags", "config_from_args",
           "method_options", "compress_config_from_args"]


def name_list(text: str) -> tuple[str, ...]:
    items = tuple(part.strip() for part in text.split(",") if part.strip())
    if not items:
        raise argparse.ArgumentTypeError("give at least one name")
    return items


def int_list(text: str) -> tuple[int, ...]:
    try:
        items = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not items or min(items) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return items


def positive_int_list(text: str) -> tuple[int, ...]:
    items = int_list(text)
    if min(items) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return items


def fraction_list(text: str) -> tuple[float, ...]:
    """Comma-separated numbers in [0, 1] (e.g. passkey depths)."""
    try:
        items = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, got {text!r}") from None
    if not items or min(items) < 0 or max(items) > 1:
        raise argparse.ArgumentTypeError(f"expected fractions in [0, 1], got {text!r}")
    return items


def add_config_flags(parser, config_class, required=(), skip=(), choices: dict | None = None) -> None:
    """One ``--field-name`` flag per dataclass field (default None = the config's own default).

    Booleans get ``--x/--no-x``; tuples take comma-separated values; help and choices come from the
    field's metadata (``config.option``), extra ``choices`` from registries the config cannot import.
    """
    for f in dataclasses.fields(config_class):
        if f.name in skip:
            continue
        flag, help_text = f"--{f.name.replace('_', '-')}", f.metadata.get("help", "")
        options = (choices or {}).get(f.name) or f.metadata.get("choices")
        if f.name in required:
            kind = type(f.default)
            parser.add_argument(flag, type=kind, required=True, help=help_text)
        elif "bool" in str(f.type):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=f"{help_text} (default {f.default})")
        elif str(f.type).startswith("tuple"):
            kind = int_list if "int" in str(f.type) else name_list
            parser.add_argument(flag, type=kind, default=None, help=help_text)
        else:
            parser.add_argument(flag, type=_scalar_type(f), default=None, choices=options,
                                help=f"{help_text} (default {f.default})")


def _scalar_type(f: dataclasses.Field) -> type:
    """The flag's type: the default's, or for a ``None`` default the annotation's (``float | None`` -> float)."""
    if f.default is not None:
        return type(f.default)
    annotation = str(f.type)
    for name, kind in (("float", float), ("int", int)):
        if name in annotation:
            return kind
    return str


def config_from_args(config_class, args, base: dict | None = None):
    """The config of the flags given (fields whose flag was not given keep ``base`` or the default)."""
    names = {f.name for f in dataclasses.fields(config_class)}
    given = {name: value for name, value in vars(args).items() if name in names and value is not None}
    return config_class(**{**(base or {}), **given})


def method_options() -> dict[type, list[str]]:
    """Each compression method options class (config/methods.py) -> the method names it serves."""
    grouped: dict[type, list[str]] = {}
    for name, spec in COMPRESS_METHODS.items():
        grouped.setdefault(spec.options, []).append(name)
    return grouped


def compress_config_from_args(args) -> CompressConfig:
    """The ``CompressConfig`` of the compress flags given: common flags, and the flags of ``--method``'s own
    options; a flag of another method's options is refused by name (``CompressConfig.from_flat``)."""
    names = {f.name for f in dataclasses.fields(CompressConfig)} - {"options"}
    for options in method_options():
        names |= {f.name for f in dataclasses.fields(options)}
    given = {name: value for name, value in vars(args).items() if name in names and value is not None}
    return CompressConfig.from_flat(given, other_defaults_ok=False)
