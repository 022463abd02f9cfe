"""The resumable state of the sequential loop (pipelines/sequential.py) in its ``RunDirectory``.

After each layer l: ``layer_<l>.safetensors`` (the compressed layer's state dict, its own key names),
one file per stream of the statistics source (pipelines/statistics_sources.py ``streams()``, ``batch_<i>``:
the hidden states leaving layer l per calibration batch): ``stream.safetensors``, and
``teacher_stream.safetensors`` with ``statistics="teacher_target"``; and ``progress.json`` (``layers_done``,
the per-layer reports, from which the replaced modules' shapes are rebuilt).
"""

from __future__ import annotations

from torch import nn

from ..modules.latent_linear import LatentLinear
from .calibration import LayerStream
from .resume import RunDirectory

__all__ = ["save_layer_progress", "restore_layers", "restore_streams"]


def save_layer_progress(run_dir: RunDirectory, index: int, layer: nn.Module, streams: dict[str, LayerStream],
                        reports: list) -> None:
    """After layer ``index``: its weights, the streams leaving it (file name -> stream; none when the fits read
    precomputed statistics) and the reports so far."""
    run_dir.save_tensors(f"layer_{index}", layer.state_dict())
    for name, stream in streams.items():
        run_dir.save_tensors(name, {f"batch_{i}": h for i, h in enumerate(stream.hidden)})
    run_dir.save_progress({"layers_done": index + 1, "reports": reports})


def restore_layers(run_dir: RunDirectory, model, adapter, config, streams: dict[str, LayerStream],
                   load_weights: bool = True) -> tuple[int, list, dict[str, LayerStream]]:
    """``(layers done, their reports, streams)``: the finished layers rebuilt from the work directory (their
    structure only, on the meta device, without ``load_weights``: the layer source's ``weights_resident``),
    and ``streams`` (file name -> the stream as captured) read back at the next boundary."""
    state = run_dir.load_progress()
    if state is None:
        return 0, [], streams
    layers = adapter.decoder_layers(model)
    for index in range(state["layers_done"]):
        layer = layers[index]
        for name, info in state["reports"][index]["matrices"].items():
            if info.get("form") == "dense":
                continue  # kept dense (--budget latency): the original nn.Linear
            linear = adapter.get_linear(layer, name)
            junction = info["form"] == "junction" if "form" in info else config.junction
            adapter.set_linear(layer, name, LatentLinear(info["in"], info["out"], info["rank"], junction=junction,
                                                         bias=linear.bias is not None, dtype=linear.weight.dtype,
                                                         device=linear.weight.device))
        if load_weights:
            layer.load_state_dict(run_dir.load_tensors(f"layer_{index}"))
    return state["layers_done"], state["reports"], restore_streams(run_dir, streams)


def restore_streams(run_dir: RunDirectory, streams: dict[str, LayerStream]) -> dict[str, LayerStream]:
    """``streams`` (file name -> the stream as captured) with the hidden states ``save_layer_progress`` wrote at the
    last finished layer (the captured keyword arguments kept)."""
    restored = {}
    for name, current in streams.items():
        saved = run_dir.load_tensors(name)
        hidden = [saved[f"batch_{i}"].to(h) for i, h in enumerate(current.hidden)]
        restored[name] = LayerStream(hidden, current.layer_kwargs, current.token_count)
    return restored
