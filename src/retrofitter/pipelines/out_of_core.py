"""Out-of-core compression: models larger than memory, one decoder layer resident at a time.

    model  = empty_model(dir)                          # config.json, every parameter on the meta device
    report = compress_model(model, ..., offload=LayerOffload(model, SafetensorsCheckpoint(dir)))
             # the sequential loop reads layer l from the shards, fits, propagates, saves
             # layer_<l>.safetensors in the work directory, frees the layer
    save_retrofitted_shards(out, ...)                  # one shard per compressed layer (read back one at a
                                                       # time) + the untouched tensors copied from the source

Peak memory ≈ one layer (dense, plus its compressed copy) + its statistics (a d×d float64 matrix per
distinct input) + the calibration activations at one layer boundary (2 × blocks × seq_len × d × 4 bytes
while a layer propagates) + the modules before layer 0 during the capture (the token embedding).
The output directory is the one ``save_retrofitted`` writes (loaded by ``retrofitter.load``), split
into shards with HF's index; the factors are those of the in-memory path (tested).

Rank plans are made from the layers' shapes only: global allocation needs every layer's spectrum and
the whole model's gradients before the first fit, so it is refused here (``--allocation uniform``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from ..checkpoint import replacement_records, save_retrofitted_shards
from ..config import CompressConfig
from .compress import compress_model
from .distributed import SINGLE_PROCESS, DataParallel
from .offload import LayerOffload, SafetensorsCheckpoint, empty_model

__all__ = ["compress_out_of_core", "OWN_SHARD_BYTES"]

OWN_SHARD_BYTES = 64 * 2**20  # a tensor outside the layers this large (embeddings, LM head) gets its own shard


def compress_out_of_core(model_dir, out, config: CompressConfig, calibration: torch.Tensor, *, work_dir,
                         dtype: torch.dtype = torch.float32, device="cpu", tokenizer=None, metadata: dict | None = None,
                         overwrite: bool = False, progress: bool = True,
                         parallel: DataParallel = SINGLE_PROCESS) -> tuple:
    """Compress the safetensors model in ``model_dir`` into ``out`` without ever holding it whole; returns
    ``(model, report)``, the model's structure (compressed) on the meta device: parameter accounting only.
    ``work_dir`` holds the finished layers and the stream (resumable; left in place for the caller to remove
    once ``out`` is in place). With several processes only rank 0 writes ``out``."""
    if config.allocation != "uniform":
        raise ValueError(f"out-of-core compression plans ranks from the layer shapes: global allocation needs the "
                         f"whole model at once; pass --allocation uniform (got {config.allocation!r})")
    checkpoint = SafetensorsCheckpoint(model_dir)
    model = empty_model(model_dir, dtype)
    offload = LayerOffload(model, checkpoint, dtype, device)
    model, report = compress_model(model, config, calibration, progress=progress, checkpoint_dir=work_dir,
                                   remove_checkpoint=False, parallel=parallel, offload=offload)
    if parallel.rank == 0:
        shards = _layer_shards(model, offload, Path(report["checkpoint_dir"])) + _outer_shards(offload, checkpoint,
                                                                                              dtype)
        save_retrofitted_shards(out, model.config, shards, replacement_records(model),
                                {**(metadata or {}), "ranks": report["ranks"]},
                                tokenizer=tokenizer, generation_config=getattr(model, "generation_config", None),
                                overwrite=overwrite)
    parallel.barrier()
    return model, report


def _layer_shards(model, offload: LayerOffload, run_path: Path) -> list:
    """(name, tensors) per compressed layer, read back from the work directory with the model's key names."""
    expected = list(model.state_dict())
    shards = []
    for index in range(len(offload.adapter.decoder_layers(model))):
        prefix = offload.layer_prefix(index)

        def tensors(index=index, prefix=prefix):
            state = {prefix + k: v for k, v in load_file(str(run_path / f"layer_{index}.safetensors")).items()}
            wanted = {k for k in expected if k.startswith(prefix)}
            if set(state) != wanted:
                raise RuntimeError(f"layer {index}: the saved tensors {sorted(set(state) ^ wanted)[:4]} differ from "
                                   f"the final structure of the model")
            return state
        shards.append((f"layer_{index}", tensors))
    return shards


def _outer_shards(offload: LayerOffload, checkpoint: SafetensorsCheckpoint, dtype: torch.dtype) -> list:
    """(name, tensors) for the tensors outside the layers, copied from the source: each large one alone."""
    keys = offload.outer_keys(head=True)
    state = offload.model.state_dict()
    sizes = {k: state[k].numel() * dtype.itemsize for k in keys}
    large = [k for k in keys if sizes[k] >= OWN_SHARD_BYTES]
    small = [k for k in keys if k not in large]
    groups = [[k] for k in large] + ([small] if small else [])
    return [(",".join(group), lambda group=group: checkpoint.read(group, dtype)) for group in groups]
