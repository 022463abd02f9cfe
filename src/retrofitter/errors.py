"""The exceptions retrofitter reports to users as one line (the CLI prints ``str(error)``; ``--debug`` adds the traceback).

Every message names the file, flag, layer or module at fault and what to do about it.
"""

from __future__ import annotations

__all__ = ["RetrofitterError", "ModelLoadError", "OutputBusyError"]


class RetrofitterError(Exception):
    """Base class of retrofitter's own errors."""


class ModelLoadError(RetrofitterError, ValueError):
    """A model (directory, alias or hub id) cannot be loaded; raised by ``retrofitter.load`` / ``load_model``."""


class OutputBusyError(RetrofitterError, FileExistsError):
    """Another retrofitter process holds the lock of the output being written."""
