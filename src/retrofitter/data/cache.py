"""The local cache of fetched models and corpora: location, checksums, manifests, atomic writes.

Layout under ``cache_dir()``::

    models/<alias>/          HF model directory (safetensors + config + tokenizer)
    corpora/<name>.txt       plain-text corpora
    manifests/<item>.json    one manifest per fetched item (sources, files, sha256, stats)
    tmp/                     scratch space on the same filesystem, so renames are atomic
    locks/<item>.lock        advisory locks so two processes do not fetch the same item at once

Every file is written to a temporary name first and then renamed into place, so a crash
never leaves a half-written file under its final name; an item counts as fetched only when
its manifest exists and every file it lists is present with the recorded size.

Integrity: a file whose bytes no longer match its manifest's sha256 raises ``CacheDamagedError`` naming the
file and the repair (``retrofitter fetch ITEM --force``). Hashing a 540 MB model costs seconds, so each use
hashes only the files whose size or modification time differ from ``manifests/<item>.verified.json``, the
stamp written after the last full check; ``retrofitter fetch`` checks every byte.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from ..errors import RetrofitterError

CACHE_ENV_VAR = "RETROFITTER_CACHE"
MANIFEST_FORMAT = 1
_HASH_CHUNK_BYTES = 1 << 20


def cache_dir() -> Path:
    """``$RETROFITTER_CACHE`` if set (and non-empty), else ``~/.cache/retrofitter``. Not created here."""
    configured = os.environ.get(CACHE_ENV_VAR, "").strip()
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "retrofitter"


def models_dir() -> Path:
    return cache_dir() / "models"


def corpora_dir() -> Path:
    return cache_dir() / "corpora"


def manifest_path(item: str) -> Path:
    return cache_dir() / "manifests" / f"{item}.json"


def scratch_dir(prefix: str) -> Path:
    """A fresh temporary directory inside the cache (same filesystem → ``os.replace`` is atomic)."""
    root = cache_dir() / "tmp"
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=root))


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks (models are hundreds of MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_HASH_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _temporary_sibling(path: Path) -> Path:
    # Same directory as the target, so the final os.replace never crosses filesystems.
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temporary sibling + ``os.replace``; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = _temporary_sibling(path)
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """UTF-8 text version of :func:`atomic_write_bytes`."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_move_dir(source: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Move a fully written directory into place, replacing a stale one at ``target``.

    Directories cannot be swapped atomically with ``os.replace`` when the target exists, so
    the stale target is first renamed aside (one rename), then the new one renamed in.
    """
    source, target = Path(source), Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    stale = None
    if target.exists():
        stale = _temporary_sibling(target)
        os.rename(target, stale)
    os.rename(source, target)
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)
    return target


def file_record(path: Path, root: Path) -> dict[str, Any]:
    """Manifest entry for one file: its path relative to ``root``, size and sha256."""
    return {"path": path.relative_to(root).as_posix(), "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def write_manifest(item: str, files: list[Path], sources: list[dict[str, Any]], stats: dict[str, Any]) -> Path:
    """Record a fetched item: its source packages, its files (relative to ``cache_dir()``) and stats."""
    root = cache_dir()
    manifest = {
        "format": MANIFEST_FORMAT,
        "item": item,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "sources": sources,
        "files": [file_record(Path(path), root) for path in sorted(files)],
        "stats": stats,
    }
    written = atomic_write_text(manifest_path(item), json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    stamps = {record["path"]: _file_stamp(root / record["path"]) for record in manifest["files"]}  # just hashed
    atomic_write_text(_stamp_path(item), json.dumps(stamps, sort_keys=True))
    return written


def read_manifest(item: str) -> dict[str, Any] | None:
    """The manifest of ``item`` or None when it was never fetched (or the file is unreadable)."""
    path = manifest_path(item)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


class CacheDamagedError(RetrofitterError, ValueError):
    """A cached file's bytes differ from the sha256 its manifest recorded when it was fetched."""


def _stamp_path(item: str) -> Path:
    return cache_dir() / "manifests" / f"{item}.verified.json"


def _file_stamp(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def manifest_is_complete(item: str, verify_checksums: bool = False) -> bool:
    """True when ``item`` has a manifest and every listed file exists with the recorded size (False: fetch it).

    A file whose sha256 differs from the manifest raises ``CacheDamagedError``. Checked: every file with
    ``verify_checksums``, otherwise the files whose size or mtime changed since the last check (module
    docstring); the stamp of the check is written where the cache is writable.
    """
    manifest = read_manifest(item)
    if manifest is None or manifest.get("format") != MANIFEST_FORMAT or not manifest.get("files"):
        return False
    root = cache_dir()
    try:
        stamps = {} if verify_checksums else json.loads(_stamp_path(item).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        stamps = {}
    checked = {}
    for record in manifest["files"]:
        path = root / record["path"]
        if not path.is_file() or path.stat().st_size != record["bytes"]:
            return False
        stamp = _file_stamp(path)
        if stamps.get(record["path"]) != stamp and sha256_file(path) != record["sha256"]:
            raise CacheDamagedError(f"cached file {path} does not match the checksum recorded when it was fetched "
                                    f"(damaged or edited since); repair it with: retrofitter fetch {item} --force")
        checked[record["path"]] = stamp
    if checked != stamps:
        with contextlib.suppress(OSError):  # a read-only cache is verified again next time
            atomic_write_text(_stamp_path(item), json.dumps(checked, sort_keys=True))
    return True


@contextlib.contextmanager
def item_lock(item: str) -> Iterator[None]:
    """Advisory exclusive lock per item, so concurrent ``fetch`` calls do the work once.

    Uses ``fcntl.flock`` where available (POSIX); elsewhere, and where the lock file cannot be created (a
    read-only cache, which can only be read), it is a no-op.
    """
    try:
        import fcntl
    except ImportError:  # Windows: no flock; concurrent fetches just redo the work.
        yield
        return
    path = cache_dir() / "locks" / f"{item}.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+")
    except OSError:  # a read-only cache: nothing can be fetched into it, so there is nothing to serialise
        yield
        return
    with handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
