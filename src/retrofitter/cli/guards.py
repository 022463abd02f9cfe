"""What the CLI checks and sets around every command: ``--json`` before any work, quiet libraries."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ..checkpoint import check_separate_paths, check_writable

__all__ = ["input_paths", "check_json_output", "quiet_libraries"]


def input_paths(args) -> dict:
    """The paths a command reads (flag -> path), which ``--json`` may not replace."""
    inputs = {}
    for name, flag in (("model", "MODEL"), ("calib", "--calib"), ("train_corpus", "--train-corpus"),
                       ("teacher", "--teacher"), ("work_dir", "--work-dir")):
        if getattr(args, name, None):
            inputs[flag] = getattr(args, name)
    for name, flag in (("corpora", "--eval"), ("models", "MODELS"), ("run_dirs", "RUN_DIRS")):
        for value in getattr(args, name, None) or ():
            inputs[f"{flag} {value}"] = value
    return inputs


def check_json_output(text: str, inputs: dict) -> Path:
    """Before any work: ``--json`` names a file that can be written, is not a directory, is none of the inputs
    (nor inside one), and, if it exists, holds a JSON object (a previous results file), which it replaces."""
    import json

    path = Path(text)
    if text.endswith(("/", os.sep)) or path.is_dir():
        raise ValueError(f"--json {text}: is a directory; give a file name, e.g. {path / 'results.json'}")
    check_writable(path, "--json")
    check_separate_paths({"--json": path}, inputs)  # --json inside --out is allowed: it is written after the save
    if path.exists():
        try:
            previous = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            previous = None
        if not isinstance(previous, dict):
            raise ValueError(f"--json {text}: exists and is not a results JSON; not replacing it (choose another file)")
    return path


@contextlib.contextmanager
def quiet_libraries(quiet: bool):
    """``--quiet``: no progress bars from transformers, huggingface_hub or any tqdm either (``TQDM_DISABLE``)."""
    if not quiet:
        yield
        return
    saved = {name: os.environ.get(name) for name in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    from transformers.utils import logging as hf_logging

    os.environ.update(TQDM_DISABLE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    try:
        hf_logging.disable_progress_bar()
        yield
    finally:
        hf_logging.enable_progress_bar()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
