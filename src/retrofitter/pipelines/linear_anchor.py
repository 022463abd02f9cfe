"""Calibrating the linear anchor of every hybrid layer (training-free; ``ops.hybrid_anchor`` has the math).

One pass of the model over calibration blocks with every hybrid layer in LoLCATs' pegged mix; a pre-hook
on each layer's hybrid core adds the regression moments of its queries (``c_n`` against the log-ratio of the
softmax's history mass to the hybrid's), then each layer gets its fitted ``[2, h]`` anchor (rows alpha, b)
and the setting ``linear_anchor`` so that ``save``/``load`` rebuild it. Later layers are fitted on the
inputs of pegged earlier layers (one pass instead of one per layer).
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from ..adapters.hybrid_attention import hybrid_attention_modules
from ..ops.hybrid_anchor import fit_anchor

__all__ = ["calibrate_linear_anchor", "clear_linear_anchor"]


@torch.no_grad()
def calibrate_linear_anchor(model: nn.Module, blocks: torch.Tensor, progress: bool = True) -> dict:
    """Fit and set the anchor of every hybrid layer of ``model`` on ``blocks`` ``[N, seq_len]`` token ids
    (in place); returns ``{"layers": {layer: {"alpha": [h], "b": [h], "queries": count}}, "blocks", "seq_len"}``."""
    modules = hybrid_attention_modules(model)
    if not modules:
        raise ValueError("the model has no hybrid attention layers: the linear anchor needs a linearized model")
    if blocks.dim() != 2 or blocks.shape[0] < 1:
        raise ValueError(f"calibration blocks must be [N >= 1, seq_len] token ids; got {tuple(blocks.shape)}")
    clear_linear_anchor(model)
    moments: dict[int, torch.Tensor] = {}
    handles = []

    def add_moments(layer: int):
        def hook(core, args):
            q, k, v = args[:3]
            mask = args[3] if len(args) > 3 else None
            found = core.anchor_moments(q, k, v, mask)
            moments[layer] = found if layer not in moments else moments[layer] + found
        return hook

    for layer, module in modules.items():
        handles.append(module.hybrid.register_forward_pre_hook(add_moments(layer)))
    device = next(model.parameters()).device
    try:
        for block in tqdm(blocks, desc="linear anchor", unit="block", disable=not progress):
            model(input_ids=block[None].to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    report = {}
    for layer, module in modules.items():
        anchor = fit_anchor(moments[layer])
        module.hybrid.set_linear_anchor(anchor)
        module.settings["linear_anchor"] = True
        report[layer] = {"alpha": anchor[0].tolist(), "b": anchor[1].tolist(), "queries": int(moments[layer][0, 0])}
    return {"layers": report, "blocks": int(blocks.shape[0]), "seq_len": int(blocks.shape[1])}


def clear_linear_anchor(model: nn.Module) -> None:
    """Back to LoLCATs' pegged mix in every hybrid layer (no anchor buffer, nothing saved for it)."""
    for module in hybrid_attention_modules(model).values():
        module.hybrid.set_linear_anchor(None)
        module.settings.pop("linear_anchor", None)
