"""The resumable state of the sequential loop (pipelines/sequential.py) in its ``RunDirectory``.

After each layer l: ``layer_<l>.safetensors`` (the compressed layer's state dict, its own key names),
``stream.safetensors`` (``batch_<i>``: the hidden states leaving layer l, per calibration batch),
``teacher_stream.safetensors`` with ``statistics="teacher_target"``, and ``progress.json``
(``layers_done``, the per-layer reports, from which the replaced modules' shapes are rebuilt).
"""

from __future__ import annotations

from torch import nn

from ..modules.latent_linear import LatentLinear
from .calibration import LayerStream
from .resume import RunDirectory

__all__ = ["save_layer_progress", "restore_layers"]


def save_layer_progress(run_dir: RunDirectory, index: int, layer: nn.Module, stream: LayerStream | None,
                        teacher_stream: LayerStream | None, reports: list) -> None:
    """After layer ``index``: its weights, the stream(s) leaving it and the reports so far."""
    run_dir.save_tensors(f"layer_{index}", layer.state_dict())
    if stream is not None:  # None: the fits read precomputed statistics
        run_dir.save_tensors("stream", {f"batch_{i}": h for i, h in enumerate(stream.hidden)})
    if teacher_stream is not None:
        run_dir.save_tensors("teacher_stream", {f"batch_{i}": h for i, h in enumerate(teacher_stream.hidden)})
    run_dir.save_progress({"layers_done": index + 1, "reports": reports})


def restore_layers(run_dir: RunDirectory, model, adapter, stream: LayerStream | None, teacher_stream: LayerStream | None,
                   config, load_weights: bool = True) -> tuple[int, list, LayerStream, LayerStream | None]:
    """Finished layers rebuilt from the work directory (their structure only, on the meta device, without
    ``load_weights``), and the stream(s) at the next boundary."""
    state = run_dir.load_progress()
    if state is None:
        return 0, [], stream, teacher_stream
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
    streams = []
    for name, current in (("stream", stream), ("teacher_stream", teacher_stream)):
        if current is None:
            streams.append(None)
            continue
        saved = run_dir.load_tensors(name)
        hidden = [saved[f"batch_{i}"].to(h) for i, h in enumerate(current.hidden)]
        streams.append(LayerStream(hidden, current.layer_kwargs, current.token_count))
    return state["layers_done"], state["reports"], *streams
