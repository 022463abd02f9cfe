"""``fetch``: provision built-in models and corpora into the cache (idempotent).

Fetch groups (what ``retrofitter fetch NAME`` accepts):

* one per model alias in :data:`MODEL_ALIASES` (``smollm2-135m``) → the HF model directory
* ``wiki``   → ``wiki-calib`` and ``wiki-eval`` text files
* ``austen`` → the ``austen`` text file
* ``all``    → everything above
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from .austen import fetch_austen
from .models import MODEL_ALIASES, fetch_model
from .wiki import fetch_wiki

ALL_GROUPS = "all"


def _model_fetcher(alias: str) -> Callable[[bool], dict[str, Path]]:
    return lambda progress: {alias: fetch_model(alias, progress=progress)}


def fetch_groups() -> dict[str, Callable[[bool], dict[str, Path]]]:
    """Registry: fetch group name → function(progress) returning {artifact name: path}."""
    groups: dict[str, Callable[[bool], dict[str, Path]]] = {alias: _model_fetcher(alias) for alias in MODEL_ALIASES}
    groups["wiki"] = lambda progress: fetch_wiki(progress=progress)
    groups["austen"] = lambda progress: {"austen": fetch_austen(progress=progress)}
    return groups


def fetch(names: list[str] | str | None = None, progress: bool = True) -> dict[str, Path]:
    """Fetch the named groups (default: all); returns {artifact name: path} for everything fetched.

    Already-fetched items are verified from their manifests and not fetched again. Raises
    ValueError for an unknown name and :class:`FetchError` (naming the item, the package and the
    reason) when a download or conversion fails.
    """
    groups = fetch_groups()
    if names is None:
        names = [ALL_GROUPS]
    elif isinstance(names, str):
        names = [names]
    unknown = [name for name in names if name != ALL_GROUPS and name not in groups]
    if unknown:
        raise ValueError(f"unknown fetch name(s) {unknown}; choose from {sorted(groups) + [ALL_GROUPS]}")
    selected = list(groups) if ALL_GROUPS in names else list(dict.fromkeys(names))
    results: dict[str, Path] = {}
    for name in selected:
        results.update(groups[name](progress))
    return results
