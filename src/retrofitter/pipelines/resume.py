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
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..data.cache import atomic_write_text

__all__ = ["ResumeMismatchError", "RunDirectory", "fingerprint"]

PROGRESS_FILE = "progress.json"


class ResumeMismatchError(ValueError):
    """The work directory holds the progress of another run."""


def fingerprint(*parts) -> str:
    """16 hex digits identifying a run: JSON-serialisable parts and tensors (their bytes) in order."""
    digest = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.Tensor):
            digest.update(part.detach().cpu().contiguous().numpy().tobytes())
        else:
            digest.update(json.dumps(part, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


class RunDirectory:
    """One run's work directory (created on first use)."""

    def __init__(self, path, run_fingerprint: str):
        self.path = Path(path)
        self.fingerprint = run_fingerprint

    def _progress_path(self) -> Path:
        return self.path / PROGRESS_FILE

    def load_progress(self) -> dict | None:
        """The saved state of this run, or None when nothing was saved yet."""
        if not self._progress_path().exists():
            return None
        progress = json.loads(self._progress_path().read_text())
        if progress.get("fingerprint") != self.fingerprint:
            raise ResumeMismatchError(
                f"{self.path} holds the unfinished work of a different run (other settings, calibration data or "
                f"model); delete that directory to start over, or finish the run that wrote it")
        return progress["state"]

    def save_progress(self, state: dict) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self._progress_path(), json.dumps({"fingerprint": self.fingerprint, "state": state},
                                                            sort_keys=True))

    def tensors_path(self, name: str) -> Path:
        return self.path / f"{name}.safetensors"

    def save_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        target = self.tensors_path(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp))
        tmp.replace(target)

    def load_tensors(self, name: str, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        device = torch.device(device)  # safetensors refuses "cpu:0" (accelerate's CPU device under torchrun)
        return load_file(str(self.tensors_path(name)), device="cpu" if device.type == "cpu" else str(device))

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
