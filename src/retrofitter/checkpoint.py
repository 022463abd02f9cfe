"""Saving and loading retrofitted models: safetensors + config.json + retrofitter.json, no pickle.

A retrofitted model is an HF causal LM in which some leaf modules were replaced (``LatentLinear``,
attention wrappers, ...). ``retrofitter.json`` records, per replaced module path, its registry type
(``adapters.replacements.replacement_types()``) and its constructor spec; loading builds the base
model from ``config.json``, puts an empty replacement of the recorded shape at each path
(``build(spec, original, model)``), then loads the safetensors state dict strictly (tied weights
excepted).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from .adapters.replacements import replacement_types

__all__ = ["save_retrofitted", "load_retrofitted", "is_retrofitted_dir", "OutputExistsError", "prepare_output_dir",
           "RETROFITTER_JSON"]

RETROFITTER_JSON = "retrofitter.json"
FORMAT_VERSION = 1


class OutputExistsError(FileExistsError):
    """An output path exists and overwriting was not requested."""


def is_retrofitted_dir(path) -> bool:
    return Path(path, RETROFITTER_JSON).is_file()


def prepare_output_dir(out, overwrite: bool) -> None:
    """Refuse an existing output unless ``overwrite`` (then it is replaced only once the new one is complete)."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise OutputExistsError(f"output {out} already exists; pass --overwrite (overwrite=True) to replace it")


def save_retrofitted(model: nn.Module, out, metadata: dict, tokenizer=None, overwrite: bool = False) -> Path:
    """Write ``model`` to directory ``out`` atomically (temp dir + rename). Returns ``out``."""
    out = Path(out)
    prepare_output_dir(out, overwrite)
    types = replacement_types()
    replaced = {}
    for path, module in model.named_modules():
        name = type(module).__name__
        if name in types and path:
            replaced[path] = {"type": name, "spec": types[name].spec(module)}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        info = {"format_version": FORMAT_VERSION, "replacements": replaced, **metadata}
        info.setdefault("versions", _versions())
        (tmp / RETROFITTER_JSON).write_text(json.dumps(info, indent=2, sort_keys=True))
        if out.exists():
            backup = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, backup)
            os.replace(tmp, out)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_retrofitted(path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> nn.Module:
    """Rebuild a model written by :func:`save_retrofitted` (safetensors only)."""
    import transformers

    path = Path(path)
    info = json.loads((path / RETROFITTER_JSON).read_text())
    config = transformers.AutoConfig.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    types = replacement_types()
    for module_path, entry in info.get("replacements", {}).items():
        if entry["type"] not in types:
            raise ValueError(f"{path}: unknown replacement type {entry['type']!r} at {module_path}; "
                             f"known: {sorted(types)} (saved by a newer retrofitter?)")
        original = model.get_submodule(module_path)
        model.set_submodule(module_path, types[entry["type"]].build(entry["spec"], original, model))
    state = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(file))
    if not state:
        raise FileNotFoundError(f"{path} holds no .safetensors weights")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = _tied_parameter_names(model)
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match the recorded structure; missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    return model.eval()


def _tied_parameter_names(model: nn.Module) -> set[str]:
    names = set()
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and getattr(model.config, "tie_word_embeddings", False):
        for name, module in model.named_modules():
            if module is head:
                names.add(f"{name}.weight")
    del embed
    return names


def _versions() -> dict:
    import transformers

    from .version import __version__

    return {"retrofitter": __version__, "torch": torch.__version__, "transformers": transformers.__version__}
