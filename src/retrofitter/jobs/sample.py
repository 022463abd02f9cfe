"""``retrofitter sample``: a text file the original model writes, continuing prompts from a corpus.

The file is calibration text like any other (``--calib FILE``, or ``--calib wiki-calib,FILE`` after a corpus):
more transfer data than a corpus holds. Samples are separated by a blank line. The file is written beside itself
as ``.NAME.partial`` with a ``.NAME.partial.json`` progress note after every batch; a rerun with the same settings
resumes after the last whole batch, and the finished file is renamed into place.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from tqdm.auto import tqdm

from ..api import load_model
from ..checkpoint import output_lock
from ..config import SampleConfig
from ..data.blocks import tokenize_text
from ..data.cache import atomic_write_text
from ..data.corpora import check_corpus, load_text
from ..pipelines.sample_text import prompt_windows, sample_batches

__all__ = ["sample_job", "partial_paths"]

SAMPLE_SEPARATOR = "\n\n"


def partial_paths(out: Path) -> tuple[Path, Path]:
    """The file being written and its progress note, beside ``out``."""
    return out.with_name(f".{out.name}.partial"), out.with_name(f".{out.name}.partial.json")


def _resume_point(out: Path, settings: dict) -> tuple[int, int]:
    """(samples done, bytes of the partial file holding them) of an earlier run with the same ``settings``;
    (0, 0) when there is none. ValueError when one with other settings is in the way."""
    partial, note_path = partial_paths(out)
    if not note_path.exists():
        return 0, 0
    note = json.loads(note_path.read_text(encoding="utf-8"))
    if note.get("settings") != settings:
        changed = sorted(k for k in set(settings) | set(note.get("settings", {}))
                         if settings.get(k) != note.get("settings", {}).get(k))
        raise ValueError(f"{partial} holds a run with other settings ({', '.join(changed)}); rerun with those "
                         f"settings to resume it, or delete {partial} and {note_path}")
    if not partial.exists() or partial.stat().st_size < note["bytes"]:
        raise ValueError(f"{note_path} records {note['bytes']} bytes written but {partial} is missing or shorter; "
                         f"delete both to start again")
    return int(note["samples"]), int(note["bytes"])


def sample_job(model_name: str, out, config: SampleConfig, *, prompts: str = "wiki-calib", overwrite: bool = False,
               dtype="float32", device="cpu", progress: bool = True) -> dict:
    """Write ``config.samples`` continuations by ``model_name`` of prompts spread over ``prompts`` to the text file
    ``out``; the report (settings, samples, tokens, seconds, resumed_from)."""
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"{out} is a directory; --out names the text file to write")
    if out.exists() and not overwrite:
        raise ValueError(f"{out} exists; pass --overwrite to replace it")
    check_corpus(prompts, "--prompts")
    settings = {"model": str(model_name), "prompts": str(prompts), "dtype": str(dtype),
                **dataclasses.asdict(config)}
    with output_lock(out):  # a second run writing the same file fails at once
        resumed_from, seconds = _write_samples(model_name, out, config, prompts, settings, dtype, device, progress)
    return {"out": str(out), "settings": settings, "samples": config.samples,
            "tokens": config.samples * (config.prompt_tokens + config.new_tokens),
            "seconds": seconds, "resumed_from": resumed_from}


def _write_samples(model_name, out: Path, config: SampleConfig, prompts, settings: dict, dtype, device,
                   progress: bool) -> tuple[int, float]:
    """Sample into the partial file from the resume point on, then rename it to ``out``: (resumed from, seconds)."""
    resumed_from, size = _resume_point(out, settings)
    done = resumed_from
    if done % config.batch_size and done < config.samples:
        raise ValueError(f"the partial run stopped after {done} samples, not a whole batch of {config.batch_size}")
    model, tokenizer = load_model(model_name, dtype=dtype, device=device)
    model.eval()
    windows = prompt_windows(tokenize_text(tokenizer, load_text(prompts, progress=progress)), config.samples,
                             config.prompt_tokens)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    partial, note_path = partial_paths(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(partial, "r+b" if done else "wb") as handle:
        handle.truncate(size)
        handle.seek(size)
        bar = tqdm(total=config.samples, initial=done, desc="sampling", unit="sample", disable=not progress)
        for first, rows in sample_batches(model, windows, config, tokenizer.bos_token_id, pad_id, start=done):
            text = "".join(tokenizer.decode(row, skip_special_tokens=True).strip() + SAMPLE_SEPARATOR for row in rows)
            handle.write(text.encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())
            done, size = first + rows.shape[0], handle.tell()
            atomic_write_text(note_path, json.dumps({"settings": settings, "samples": done, "bytes": size}))
            bar.update(rows.shape[0])
        bar.close()
    os.replace(partial, out)
    note_path.unlink()
    return resumed_from, round(time.monotonic() - started, 1)
