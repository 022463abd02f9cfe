"""Resumable runs: a work directory with a fingerprint, a progress record and atomically written files.

Used by every long pipeline (sequential compression, block-wise attention transfer)::

    run = RunDirectory(path, fingerprint(config.to_dict(), calibration))
    state = run.load_progress()        # None for a fresh directory
    ...                                # work, then after each unit:
    run.save_tensors("layer_3", {...}); run.save_progress({"layers_done": 4, ...})
    run.remove()                       # once the final output is in place

Policy: a directory that holds the progress of a *different* run (other settings, other calibration
data, other model) is neither reused nor deleted: ``ResumeMismatchError`` names it, so finished work
is never thrown away silently. Every file is written to a temporary sibling and renamed, so an
interrupted write never leaves a truncated file behind.

Ownership: retrofitter removes only what it created. A work directory is taken only when it is new, empty
or already a retrofitter work directory (``check_work_dir``, before any work: a folder of the user's is
refused, never used). The first write marks it (``.retrofitter-work``, recording whether retrofitter
created the directory); ``remove_work_dir`` deletes only retrofitter's own file names in a marked directory
(the progress record, ``*.safetensors``, temporary ``.*.tmp`` files, the marker), then the subdirectories
that became empty, and the directory itself only when retrofitter created it and nothing else is left.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..data.cache import atomic_write_text

__all__ = ["ResumeMismatchError", "UnsafeWorkDirError", "RunDirectory", "fingerprint", "layer_run_fingerprint",
           "check_work_dir", "remove_work_dir", "WORK_MARKER"]

PROGRESS_FILE = "progress.json"
WORK_MARKER = ".retrofitter-work"


class ResumeMismatchError(ValueError):
    """The work directory holds the progress of another run."""


class UnsafeWorkDirError(ValueError):
    """A work directory would be a folder that holds files retrofitter did not write."""


def is_work_dir(path) -> bool:
    """Whether ``path`` is a directory retrofitter marked as its work directory (or an older run's, which left
    only its progress record as the sign)."""
    path = Path(path)
    return path.is_dir() and ((path / WORK_MARKER).is_file() or (path / PROGRESS_FILE).is_file())


def check_work_dir(path, what: str = "work directory") -> None:
    """Raise ``UnsafeWorkDirError`` naming ``what`` unless ``path`` may be used as a work directory: it does not
    exist, is an empty directory, or is a retrofitter work directory already (to resume). Creates nothing."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_dir():
        raise UnsafeWorkDirError(f"{what} {path}: exists and is not a directory; choose a new or empty directory")
    if is_work_dir(path):
        return
    foreign = next(iter(sorted(p.name for p in path.iterdir())), None)
    if foreign is not None:
        raise UnsafeWorkDirError(f"{what} {path}: holds files retrofitter did not write (e.g. {foreign!r}), which it "
                                 f"would mix with its own; choose a new or empty directory")


def _is_own_file(name: str) -> bool:
    return (name in (PROGRESS_FILE, WORK_MARKER) or name.endswith(".safetensors")
            or (name.startswith(".") and ".tmp" in name))


def remove_work_dir(path) -> bool:
    """Remove what retrofitter wrote in the work directory ``path`` (module docstring: Ownership); a directory
    without the mark is left as it is. Returns whether ``path`` itself was removed."""
    path = Path(path)
    if not is_work_dir(path):
        return False
    marker = path / WORK_MARKER
    try:
        created = bool(json.loads(marker.read_text()).get("created", False)) if marker.is_file() else False
    except (OSError, ValueError, AttributeError):
        created = False
    for directory, subdirectories, files in os.walk(path, topdown=False):  # never follows symlinks
        for name in files:
            if _is_own_file(name):
                Path(directory, name).unlink(missing_ok=True)
        for name in subdirectories:
            child = Path(directory, name)
            if not child.is_symlink():
                _remove_if_empty(child)
    return created and _remove_if_empty(path)


def _remove_if_empty(directory: Path) -> bool:
    try:
        directory.rmdir()
    except OSError:  # not empty: something retrofitter did not write is in it
        return False
    return True


def fingerprint(*parts) -> str:
    """16 hex digits identifying a run: JSON-serialisable parts and tensors (their bytes) in order."""
    digest = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.Tensor):
            digest.update(part.detach().cpu().contiguous().numpy().tobytes())
        else:
            digest.update(json.dumps(part, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


def layer_run_fingerprint(config, calibration: torch.Tensor, model) -> str:
    """The fingerprint of a layer-by-layer conversion: its settings (``config.to_dict()``), the calibration blocks,
    and the model's name and configuration."""
    return fingerprint(config.to_dict(), calibration, str(getattr(model, "name_or_path", "")), model.config.to_dict())


class RunDirectory:
    """One run's work directory (created on first use)."""

    def __init__(self, path, run_fingerprint: str):
        self.path = Path(path)
        self.fingerprint = run_fingerprint
        check_work_dir(self.path)

    def _ensure(self) -> None:
        """Create and mark the directory on the first write; every directory created on the way is marked as
        created by retrofitter (so the top one of ``.OUT.partial/rank0`` is removed too)."""
        if (self.path / WORK_MARKER).is_file():
            return
        new = [self.path, *(p for p in self.path.parents if not p.exists())] if not self.path.exists() else []
        self.path.mkdir(parents=True, exist_ok=True)
        for directory in new or [self.path]:
            if not (directory / WORK_MARKER).is_file():
                atomic_write_text(directory / WORK_MARKER, json.dumps({"created": bool(new)}))

    def _progress_path(self) -> Path:
        return self.path / PROGRESS_FILE

    def load_progress(self) -> dict | None:
        """The saved state of this run, or None when nothing was saved yet."""
        if not self._progress_path().exists():
            return None
        try:
            progress = json.loads(self._progress_path().read_text())
            if not isinstance(progress, dict) or not isinstance(progress.get("state"), dict):
                raise ValueError("not a progress record")
        except (OSError, ValueError) as error:
            raise ResumeMismatchError(f"{self._progress_path()}: unreadable progress record ({error}); delete "
                                      f"{self.path} to start over") from None
        if progress.get("fingerprint") != self.fingerprint:
            raise ResumeMismatchError(
                f"{self.path} holds the unfinished work of a different run (other settings, calibration data or "
                f"model); delete that directory to start over, or finish the run that wrote it")
        return progress["state"]

    def save_progress(self, state: dict) -> None:
        self._ensure()
        atomic_write_text(self._progress_path(), json.dumps({"fingerprint": self.fingerprint, "state": state},
                                                            sort_keys=True))

    def tensors_path(self, name: str) -> Path:
        return self.path / f"{name}.safetensors"

    def save_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        self._ensure()
        target = self.tensors_path(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp))
        tmp.replace(target)

    def load_tensors(self, name: str, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        device = torch.device(device)  # safetensors refuses "cpu:0" (accelerate's CPU device under torchrun)
        try:
            return load_file(str(self.tensors_path(name)), device="cpu" if device.type == "cpu" else str(device))
        except Exception as error:  # noqa: BLE001 — safetensors raises its own error type for damaged files
            raise ResumeMismatchError(f"{self.tensors_path(name)}: the saved work cannot be read back ({error}); "
                                      f"delete {self.path} to start over") from None

    def remove(self) -> None:
        """Remove what this run wrote (``remove_work_dir``)."""
        remove_work_dir(self.path)
