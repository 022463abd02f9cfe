"""Saving and loading retrofitted models: safetensors + config.json + retrofitter.json, no pickle.

A retrofitted model is an HF causal LM in which some leaf modules were replaced (``LatentLinear``,
attention wrappers, ...). ``retrofitter.json`` records, per replaced module path, its registry type
(``adapters.replacements.replacement_types()``) and its constructor spec; loading builds the base
model from ``config.json``, puts an empty replacement of the recorded shape at each path
(``build(spec, original, model)``), then loads the safetensors state dict strictly (tied weights
excepted).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from .adapters.registry import auto_class_for
from .adapters.replacements import replacement_types
from .errors import ModelLoadError, OutputBusyError
from .modules.quantize import quantized_scheme

__all__ = ["save_retrofitted", "save_retrofitted_shards", "replacement_records",
           "load_retrofitted", "read_retrofitter_json", "is_retrofitted_dir", "OutputExistsError", "prepare_output_dir", "check_separate_paths", "check_writable", "output_lock", "check_weight_files", "staged_output",
           "RETROFITTER_JSON", "conversion_metadata"]

RETROFITTER_JSON = "retrofitter.json"
FORMAT_VERSION = 1


class OutputExistsError(FileExistsError):
    """An output path exists and overwriting was not requested."""


def is_retrofitted_dir(path) -> bool:
    return Path(path, RETROFITTER_JSON).is_file()


def prepare_output_dir(out, overwrite: bool) -> str | None:
    """Refuse an existing output unless ``overwrite``; then it is replaced only once the new one is complete,
    and only when it is a previous retrofitter output (a directory with ``retrofitter.json``) or an empty
    directory: anything else (a folder of the user's, a file) is refused even with ``overwrite``.
    Returns what will be replaced, in words (None when ``out`` does not exist)."""
    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return None
    if not overwrite:
        raise OutputExistsError(f"output {out} already exists; pass --overwrite (overwrite=True) to replace it")
    if is_retrofitted_dir(out):
        try:
            info = read_retrofitter_json(out)
            what = f"{info.get('method', 'a conversion')} of {info.get('source_model', '?')}"
        except ModelLoadError:  # a damaged retrofitter.json: still our output, described without it
            what = "a conversion"
        return f"the retrofitter output {out} ({what})"
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        return f"the empty directory {out}"
    kind = "a file" if not out.is_dir() else "a directory without retrofitter.json"
    raise OutputExistsError(f"output {out} is {kind}, not a retrofitter output: --overwrite replaces only a previous "
                            f"retrofitter output or an empty directory; move it away or choose another --out")


def check_separate_paths(outputs: dict[str, object], inputs: dict[str, object]) -> None:
    """Refuse (``ValueError`` naming both flags) an output path that equals, contains or lies inside an input
    path: replacing or cleaning the output would then destroy the input. ``outputs`` / ``inputs`` map a flag
    (``--out``, ``MODEL``) to a path; None values and inputs that are not local paths (aliases, hub ids,
    built-in corpus names) are skipped."""
    resolved_inputs = {flag: Path(p).expanduser().resolve() for flag, p in inputs.items()
                       if p is not None and Path(p).expanduser().exists()}
    for out_flag, out in outputs.items():
        if out is None:
            continue
        target = Path(out).expanduser().resolve()
        for in_flag, source in resolved_inputs.items():
            if target == source:
                relation = "is"
            elif target in source.parents:
                relation = "contains"
            elif source in target.parents:
                relation = "lies inside"
            else:
                continue
            raise ValueError(f"{out_flag} {out} {relation} the input {in_flag} {inputs[in_flag]}; write the output "
                             f"somewhere else")


def check_writable(path, what: str = "output") -> None:
    """Fail before any work when ``path`` (a file or directory to create) cannot be written: its nearest
    existing ancestor must be a directory in which a file can be created (a probe, so it holds for root)."""
    path = Path(path).expanduser().absolute()
    ancestor = path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise NotADirectoryError(f"{what} {path}: {ancestor} is a file, not a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=ancestor, prefix=".retrofitter-probe-"):
            pass
    except OSError as error:
        raise PermissionError(f"{what} {path}: cannot write in {ancestor} ({error.strerror})") from None


@contextlib.contextmanager
def output_lock(out) -> Iterator[None]:
    """Hold ``.OUT.lock`` beside ``out`` for one run: a second run writing the same output fails at once
    with ``OutputBusyError`` naming the first one's pid. The lock is released (and its file removed) on exit."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out.parent / f".{out.name}.lock"
    handle = open(lock_path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "?"
        handle.close()
        raise OutputBusyError(f"another retrofitter run (pid {owner}) is writing {out}; wait for it to finish or "
                              f"choose another --out") from None
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        yield
    finally:
        lock_path.unlink(missing_ok=True)
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def save_retrofitted(model: nn.Module, out, metadata: dict, tokenizer=None, overwrite: bool = False) -> Path:
    """Write ``model`` to directory ``out`` atomically (temp dir + rename). Returns ``out``.

    A quantized model (``modules.quantize``) is refused: its int8 tensor subclasses have no safetensors
    layout that ``load_retrofitted`` reads; save the float model and quantize after loading."""
    if quantized_scheme(model) is not None:
        raise ValueError(f"cannot save a quantized model ({quantized_scheme(model)}): save the float model and "
                         f"quantize it after loading (--quantize)")
    out = Path(out)
    prepare_output_dir(out, overwrite)
    replaced = replacement_records(model)
    with staged_output(out) as tmp:
        # The module names as they are (no reverse key renaming: GPT-NeoX's lm_head would become embed_out,
        # which this loader, reading safetensors directly, would not map back).
        model.save_pretrained(tmp, safe_serialization=True, save_original_format=False)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _write_info(tmp, replaced, metadata)
    return out


def replacement_records(model: nn.Module) -> dict:
    """Module path -> ``{"type", "spec"}`` of every replaced module (``retrofitter.json``'s ``replacements``);
    reads module structure only, so a model on the meta device describes itself too."""
    types = replacement_types()
    replaced = {}
    for path, module in model.named_modules():
        name = type(module).__name__
        if name in types and path:
            replaced[path] = {"type": name, "spec": types[name].spec(module)}
    return replaced


def save_retrofitted_shards(out, config, shards: list[tuple[str, Callable[[], dict]]], replacements: dict,
                            metadata: dict, tokenizer=None, generation_config=None, overwrite: bool = False) -> Path:
    """Write a model one shard at a time (out-of-core compression): ``shards`` lists (name, a function returning
    that shard's tensors), each called, written and dropped in turn. Same directory as
    :func:`save_retrofitted` (``config.json``, ``retrofitter.json``, safetensors), the weights split into
    ``model-0000i-of-0000n.safetensors`` with HF's ``model.safetensors.index.json``; atomic like it."""
    from safetensors.torch import save_file

    out = Path(out)
    prepare_output_dir(out, overwrite)
    weight_map, total = {}, 0
    with staged_output(out) as tmp:
        for number, (_name, tensors_of) in enumerate(shards, start=1):
            file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            tensors = {k: v.detach().contiguous() for k, v in tensors_of().items()}
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            weight_map.update({key: file for key in tensors})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config.save_pretrained(tmp)
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _write_info(tmp, replacements, metadata)
    return out


def _write_info(directory: Path, replacements: dict, metadata: dict) -> None:
    info = {"format_version": FORMAT_VERSION, "replacements": replacements, **metadata}
    info.setdefault("versions", _versions())
    (directory / RETROFITTER_JSON).write_text(json.dumps(info, indent=2, sort_keys=True))


@contextlib.contextmanager
def staged_output(out: Path) -> Iterator[Path]:
    """A temporary sibling directory of ``out`` for the body to fill; renamed to ``out`` (replacing it) when
    the body succeeds, removed when it fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; the output gets the user's normal permissions
        yield tmp
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


def conversion_metadata(path) -> dict:
    """The metadata a conversion recorded in ``retrofitter.json`` (method, source model, config, ...), without
    the file's own bookkeeping (format version, replacement records, library versions): what a command that
    rewrites the directory (heal, recall) carries over."""
    return {k: v for k, v in read_retrofitter_json(path).items()
            if k not in ("format_version", "replacements", "versions")}


def read_retrofitter_json(path) -> dict:
    """``retrofitter.json`` of a saved directory, checked: a JSON object of a known format version whose
    ``replacements`` map module paths to ``{"type": known type, "spec": {...}}``."""
    file = Path(path) / RETROFITTER_JSON
    try:
        info = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"{file}: not readable JSON ({error})") from None
    if not isinstance(info, dict):
        raise ModelLoadError(f"{file}: expected a JSON object, got {type(info).__name__}")
    version = info.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise ModelLoadError(f"{file}: missing or invalid format_version {version!r}")
    if version > FORMAT_VERSION:
        raise ModelLoadError(f"{file}: format_version {version} was written by a newer retrofitter (this one reads "
                             f"up to {FORMAT_VERSION}); upgrade retrofitter to load it")
    replacements = info.get("replacements", {})
    if not isinstance(replacements, dict):
        raise ModelLoadError(f"{file}: 'replacements' must be an object of module path -> entry")
    known = replacement_types()
    for module_path, entry in replacements.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("spec"), dict):
            raise ModelLoadError(f"{file}: replacement {module_path!r} must be {{\"type\": ..., \"spec\": {{...}}}}")
        if entry.get("type") not in known:
            raise ModelLoadError(f"{file}: unknown replacement type {entry.get('type')!r} at {module_path}; known: "
                                 f"{sorted(known)} (saved by a newer retrofitter?)")
    return info


def load_retrofitted(path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> nn.Module:
    """Rebuild a model written by :func:`save_retrofitted` (safetensors only).

    ``retrofitter.json`` and the weights are checked against each other before anything is loaded;
    every inconsistency raises ``ModelLoadError`` naming the first entry at fault.
    """
    import transformers

    path = Path(path)
    info = read_retrofitter_json(path)
    config = transformers.AutoConfig.from_pretrained(path)
    model = auto_class_for(config).from_config(config, dtype=torch.float32)  # LLaVA: AutoModelForImageTextToText
    types = replacement_types()
    for module_path, entry in info.get("replacements", {}).items():
        try:
            original = model.get_submodule(module_path)
            model.set_submodule(module_path, types[entry["type"]].build(entry["spec"], original, model))
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise ModelLoadError(f"{path / RETROFITTER_JSON}: replacement {module_path!r} does not fit the model "
                                 f"of config.json ({error})") from None
    state = _read_weights(path)
    expected = model.state_dict()
    for key, tensor in state.items():
        if key in expected and tuple(expected[key].shape) != tuple(tensor.shape):
            raise ModelLoadError(f"{path}: weight {key} has shape {tuple(tensor.shape)} but retrofitter.json and "
                                 f"config.json describe {tuple(expected[key].shape)} (edited ranks or mixed files?)")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = _tied_parameter_names(model)
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ModelLoadError(f"{path}: weights do not match the recorded structure; missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    return model.eval()


def check_weight_files(path) -> None:
    """Open the header of every ``*.safetensors`` file of directory ``path``: a damaged one raises
    ``ModelLoadError`` naming it (the header check also catches files cut short). A directory with pickle
    weights only (``pytorch_model.bin``, ``*.pt``) is refused: retrofitter never unpickles."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files and Path(path, "config.json").is_file():
        pickles = sorted(p.name for pattern in ("*.bin", "*.pt", "*.pth", "*.ckpt") for p in Path(path).glob(pattern))
        if pickles:
            raise ModelLoadError(f"model {path}: holds pickle weights only ({pickles[0]}); retrofitter reads safetensors "
                                 f"only and never unpickles: convert it once where you trust the file (transformers' "
                                 f"save_pretrained writes safetensors)")
    for file in files:
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as error:  # noqa: BLE001 — safetensors raises its own error type for damaged files
            raise ModelLoadError(f"{file}: not a readable safetensors file ({error}); it is truncated or damaged — "
                                 f"save or copy it again") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(path.glob("*.safetensors")):
        try:
            state.update(load_file(file))
        except Exception as error:  # noqa: BLE001 — safetensors raises its own error type for damaged files
            raise ModelLoadError(f"{file}: not a readable safetensors file ({error}); it is truncated or damaged — "
                                 f"save or copy it again") from None
    if not state:
        raise ModelLoadError(f"{path} holds no .safetensors weights")
    return state


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
