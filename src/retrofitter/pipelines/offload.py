"""Sequential onloading: a model on the meta device whose pieces are read from safetensors when needed.

The model is built from ``config.json`` under accelerate's ``init_empty_weights`` (parameters on the
meta device, buffers such as rotary tables computed for real). The sequential loop
(pipelines/sequential.py) then asks a :class:`LayerOffload` for

    capturing():    the modules outside the decoder layers (embeddings, ...; not an untied LM head)
                    materialised while the inputs of layer 0 are captured, then freed
    onload(l):      decoder layer l's tensors read from the shards (memory-mapped ``safe_open``, closed
                    right after the read), cast to the working dtype, placed on the device
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
from ..errors import ModelLoadError
from ..eval.resources import release_free_heap_memory

__all__ = ["SafetensorsCheckpoint", "LayerOffload", "empty_model", "SAFETENSORS_INDEX"]

SAFETENSORS_INDEX = "model.safetensors.index.json"


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
            raise ModelLoadError(f"{self.directory} holds no .safetensors weights (out-of-core compression reads "
                                 f"safetensors shards only)")

    def __contains__(self, key: str) -> bool:
        return key in self.files

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


def _set_tensor(module: nn.Module, name: str, device, value: torch.Tensor | None = None) -> None:
    from accelerate.utils import set_module_tensor_to_device

    set_module_tensor_to_device(module, name, device, value=value)


class LayerOffload:
    """The :class:`~retrofitter.pipelines.sequential.LayerOffload` of a meta ``model`` read from ``checkpoint``."""

    def __init__(self, model: nn.Module, checkpoint: SafetensorsCheckpoint, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.model, self.checkpoint, self.dtype, self.device = model, checkpoint, dtype, torch.device(device)
        self.adapter: ModelAdapter = adapter_for(model)
        if self.adapter.fused:
            raise UnsupportedArchitectureError(
                f"out-of-core compression does not split fused projections ({self.adapter.family}: "
                f"{', '.join(f.path for f in self.adapter.fused)}); compress this model in memory")

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

    def release(self, index: int, layer: nn.Module) -> None:
        layer.to("meta")
        release_free_heap_memory()  # glibc keeps freed layer-sized blocks otherwise: RSS would creep up
