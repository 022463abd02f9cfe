"""``retrofitter export``: a saved model (or any model) written for another engine (docs/export.md)."""

from __future__ import annotations

from ..api import export, load_model
from ..checkpoint import check_separate_paths, is_retrofitted_dir, output_lock, read_retrofitter_json

__all__ = ["export_job"]


def export_job(model_name: str, out, fmt: str, *, outtype: str = "f32", overwrite: bool = False,
               verify: bool = True, progress: bool = True) -> dict:
    """Load ``model_name`` (a retrofitter output or any model) and export it (``api.export``); one run at a time
    may write ``out``, which may not be the input. Returns the export record (not a results record: nothing
    is evaluated, and ``api.export`` writes and checks ``out`` in its own format)."""
    check_separate_paths({"--out": out}, {"MODEL": model_name})
    with output_lock(out):
        model, tokenizer = load_model(model_name, dtype="float32")
        metadata = {"source_model": str(model_name)}
        if is_retrofitted_dir(model_name):
            info = read_retrofitter_json(model_name)
            metadata.update(method=info.get("method"), original_model=info.get("source_model"))
        return export(model, out, fmt, tokenizer=tokenizer, overwrite=overwrite, outtype=outtype, verify=verify,
                      progress=progress, metadata=metadata)
