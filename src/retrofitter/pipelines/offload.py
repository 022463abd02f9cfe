"""Sequential onloading: a model on the meta device whose pieces are read from safetensors when needed.

The model is built from ``config.json`` under accelerate's ``init_empty_weights`` (parameters on the
meta device, buffers such as rotary tables computed for real). :class:`LayerOffload` is the sequential
loop's layer source (pipelines/layer_sources.py ``LayerSource``; pipelines/sequential.py):

    capturing():    the modules outside the decoder layers (embeddings, ...; not an untied LM head)
                    materialised while the inputs of layer 0 are captured, then freed
    onload(l):      decoder layer l's tensors read from the shards (memory-mapped ``safe_open``, closed
                    right after the read), cast to the working dtype, placed on the device, then checked
                    (``check_onloaded``: nothing was checked up front, ``weights_resident`` is False)
    lead_layer_pivots(l): layer l's MLP pivots led before its checkpoint (it leaves memory after)
    release(l):     layer l's tensors back to the meta device (its compressed weights are saved by the
                    loop's checkpoint), the replaced module structure kept for the final metadata

so resident memory holds one layer, its statistics and the calibration activations at one boundary
whatever the model size. :class:`SafetensorsCheckpoint` maps tensor names to shard files (from
``model.safetensors.index.json`` when present, else from the headers of every ``*.safetensors``).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from ..adapters import ModelAdapter, UnsupportedArchitectureError, adapter_for, auto_class_for
from ..adapters.mlp_permutation import lead_mlp_pivots
from ..errors import ModelLoadError
from ..eval.resources import release_free_heap_memory
from .layer_sources import check_layer_weights

__all__ = ["SafetensorsCheckpoint", "LayerOffload", "empty_model", "load_as_copies", "SAFETENSORS_INDEX"]

SAFETENSORS_INDEX = "model.safetensors.index.json"
# safetensors header dtype -> torch (integers map to their own; an unknown name maps to None)
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


class SafetensorsCheckpoint:
    """Tensor name -> shard file of a model directory; tensors are read on demand (module docstring)."""

    def __init__(self, directory):
        self.directory = Path(directory)
        index = self.directory / SAFETENSORS_INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {key: self.directory / name for key, name in weight_map.items()}
        else:
            self.files = {}
            for file in sorted(self.directory.glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as handle:
                    self.files.update({key: file for key in handle.keys()})
        if not self.files:
            raise ModelLoadError(f"{self.directory} holds no .safetensors weights (retrofitter reads safetensors "
                                 f"only)")

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def floating_dtypes(self) -> set[torch.dtype]:
        """The dtypes of the stored floating tensors (from the headers; nothing is read)."""
        dtypes = set()
        for file in sorted(set(self.files.values())):
            with safe_open(str(file), framework="pt") as handle:
                dtypes |= {_SAFETENSORS_DTYPES.get(handle.get_slice(key).get_dtype()) for key in handle.keys()}
        return {d for d in dtypes if d is None or d.is_floating_point}

    def read(self, keys, dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """``keys`` read shard by shard (each file mapped once, then closed), floating tensors cast to ``dtype``,
        on ``device``."""
        missing = [k for k in keys if k not in self.files]
        if missing:
            raise ModelLoadError(f"{self.directory}: no tensor {missing[0]!r} in the safetensors shards (the "
                                 f"checkpoint names its weights differently from the model; use the in-memory path)")
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.files[key], []).append(key)
        tensors = {}
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt") as handle:
                for name in names:
                    tensor = handle.get_tensor(name)  # a view of the memory-mapped file
                    # Always a copy: a view would keep the whole file mapped, and every page read so far
                    # resident, for as long as any tensor of it lives (RSS grew by a layer per layer).
                    tensors[name] = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None,
                                              copy=True)
        return tensors


def empty_model(directory, dtype: torch.dtype) -> nn.Module:
    """The model of ``directory/config.json`` with every parameter on the meta device (no memory), eval mode."""
    import transformers
    from accelerate import init_empty_weights

    config = transformers.AutoConfig.from_pretrained(directory, trust_remote_code=False)
    with init_empty_weights(include_buffers=False):
        model = auto_class_for(config).from_config(config, dtype=dtype)
    return model.eval()


def load_as_copies(directory, dtype: torch.dtype, chunk_bytes: int = 64 << 20) -> nn.Module | None:
    """The model of a plain HF safetensors ``directory`` with every tensor an owned copy, or None where
    transformers' loader is needed: a stored floating dtype other than ``dtype`` (its cast copies anyway)
    or tensor names that are not the model's (it renames them while loading).

    ``from_pretrained`` leaves same-dtype weights as views of the memory-mapped file: a page once read
    then stays resident while any weight of the file lives, so a compression that replaces weights layer by
    layer still holds the whole original file at its end. Here tensors are read in chunks of about
    ``chunk_bytes``, each under its own mapping closed after the copy: the peak is the model plus one chunk,
    and a replaced weight's memory is freed with it.
    """
    import transformers

    checkpoint = SafetensorsCheckpoint(directory)
    if checkpoint.floating_dtypes() != {dtype}:
        return None  # another stored dtype: transformers' cast copies anyway
    model = empty_model(directory, dtype)
    expected = dict(model.state_dict(keep_vars=True))
    if not set(checkpoint.files) <= set(expected):
        return None
    chunks, chunk, size = [], [], 0
    for key in checkpoint.files:
        chunk.append(key)
        size += expected[key].numel() * expected[key].element_size()
        if size >= chunk_bytes:
            chunks, chunk, size = chunks + [chunk], [], 0
    for keys in chunks + [chunk]:
        if keys:
            model.load_state_dict(checkpoint.read(keys, dtype), strict=False, assign=True)
    model.tie_weights()
    if any(t.is_meta for t in model.state_dict().values()):
        return None  # a weight the checkpoint does not name (and no tie fills): leave it to transformers
    generation = Path(directory) / "generation_config.json"
    if generation.is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(directory)
    return model.eval()


def _set_tensor(module: nn.Module, name: str, device, value: torch.Tensor | None = None) -> None:
    from accelerate.utils import set_module_tensor_to_device

    set_module_tensor_to_device(module, name, device, value=value)


class LayerOffload:
    """The :class:`~retrofitter.pipelines.layer_sources.LayerSource` of a meta ``model`` read from ``checkpoint``."""

    weights_resident = False  # each layer is checked when read; a resumed run keeps finished layers on meta

    def __init__(self, model: nn.Module, checkpoint: SafetensorsCheckpoint, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.model, self.checkpoint, self.dtype, self.device = model, checkpoint, dtype, torch.device(device)
        self.adapter: ModelAdapter = adapter_for(model)
        if self.adapter.fused:
            raise UnsupportedArchitectureError(
                f"out-of-core compression does not split fused projections ({self.adapter.family}: "
                f"{', '.join(f.path for f in self.adapter.fused)}); compress this model in memory")

    def check_run(self, calibration: torch.Tensor | None, checkpoint_dir) -> None:
        """The finished layers' weights live in the checkpoint directory, and nothing is read without a stream."""
        if checkpoint_dir is None or calibration is None:
            raise ValueError("out-of-core compression needs the calibration blocks and a checkpoint directory")

    def layer_prefix(self, index: int) -> str:
        return f"{self.adapter.decoder_path}.{index}."

    def outer_keys(self, head: bool) -> list[str]:
        """State-dict names outside the decoder layers (the LM head only with ``head``; a tied head never)."""
        prefix = f"{self.adapter.decoder_path}."
        keys = [k for k in self.model.state_dict() if not k.startswith(prefix)]
        output = self.model.get_output_embeddings()
        tied = getattr(self.adapter.text_config(self.model), "tie_word_embeddings", False)
        head_keys = {f"{n}.weight" for n, m in self.model.named_modules() if m is output and output is not None}
        head_keys |= {f"{n}.bias" for n, m in self.model.named_modules() if m is output and output is not None}
        return [k for k in keys if k not in head_keys or (head and not tied)]

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """The modules before layer 0 materialised for the body (the input capture), then freed."""
        keys = self.outer_keys(head=False)
        for key, tensor in self.checkpoint.read(keys, self.dtype, self.device).items():
            _set_tensor(self.model, key, self.device, tensor)
        try:
            yield
        finally:
            for key in keys:
                _set_tensor(self.model, key, "meta")
            release_free_heap_memory()

    def onload(self, index: int, layer: nn.Module) -> None:
        prefix = self.layer_prefix(index)
        names = list(layer.state_dict())
        tensors = self.checkpoint.read([prefix + n for n in names], self.dtype, self.device)
        for name in names:
            _set_tensor(layer, name, self.device, tensors[prefix + name])

    def check_onloaded(self, adapter: ModelAdapter, index: int, layer: nn.Module, targets: list[str]) -> None:
        check_layer_weights(adapter, layer, index, targets)

    def lead_layer_pivots(self, model: nn.Module, index: int) -> dict:
        """Layer ``index``'s MLP pivots led now, before the layer is saved and freed."""
        return {"mlp_pivots_lead": lead_mlp_pivots(model, [index])}

    def lead_remaining_pivots(self, model: nn.Module, layer_reports: list[dict]) -> int:
        """Nothing left to lead (each layer's were led before its save): their count, from the reports."""
        return sum(r.get("mlp_pivots_lead", 0) for r in layer_reports)

    def release(self, index: int, layer: nn.Module) -> None:
        layer.to("meta")
        release_free_heap_memory()  # glibc keeps freed layer-sized blocks otherwise: RSS would creep up
