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
from .cache import manifest_is_complete
from .models import MODEL_ALIASES, fetch_model
from .wiki import fetch_wiki

ALL_GROUPS = "all"


Fetcher = Callable[[bool, bool], dict[str, Path]]  # (progress, force) -> {artifact name: path}


def _model_fetcher(alias: str) -> Fetcher:
    return lambda progress, force: {alias: fetch_model(alias, progress=progress, force=force)}


def fetch_groups() -> dict[str, Fetcher]:
    """Registry: fetch group name (= its cache item) → function(progress, force) returning {artifact name: path}."""
    groups: dict[str, Fetcher] = {alias: _model_fetcher(alias) for alias in MODEL_ALIASES}
    groups["wiki"] = lambda progress, force: fetch_wiki(progress=progress, force=force)
    groups["austen"] = lambda progress, force: {"austen": fetch_austen(progress=progress, force=force)}
    return groups


def fetch(names: list[str] | str | None = None, progress: bool = True, verify: bool = False,
          force: bool = False) -> dict[str, Path]:
    """Fetch the named groups (default: all); returns {artifact name: path} for everything fetched.

    Already-fetched items are checked against their manifests (sizes, and the checksums of files changed
    since their last check; every checksum with ``verify``) and not fetched again; ``force`` fetches them
    again (the repair of a damaged file). Raises ValueError for an unknown name, ``CacheDamagedError`` naming
    a damaged file, and :class:`FetchError` (naming the item, the package and the reason) when a download or
    conversion fails.
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
        if verify and not force:
            manifest_is_complete(name, verify_checksums=True)  # raises on a damaged file; False: fetched below
        results.update(groups[name](progress, force))
    return results
