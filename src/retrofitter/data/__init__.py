"""Corpora, calibration token blocks and provisioning of built-in models (design.md §2).

Names are resolved lazily so that ``import retrofitter.data`` does not import torch or transformers.
"""

from importlib import import_module

_EXPORTS = {
    "cache_dir": "cache", "FetchError": "packages",
    "MODEL_ALIASES": "models", "fetch_model": "models", "resolve_model_source": "models",
    "CORPORA": "corpora", "load_text": "corpora",
    "token_blocks": "blocks", "calibration_blocks": "blocks", "with_repeated_spans": "blocks",
    "fetch_groups": "fetch",
}
# `fetch` (the function) is not re-exported: the name belongs to the submodule
# retrofitter.data.fetch, and importing that submodule rebinds the package attribute.
# Use `from retrofitter.data.fetch import fetch`.

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
