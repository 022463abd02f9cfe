"""MLP transfer for a converted decoder layer: once its attention is replaced (and transferred,
pipelines/mla_transfer.py), the layer's MLP learns to land the layer's output on the original model's stream.

For layer l with the converted stream h [b, n, d] entering it and the original model's stream y = h_T' [b, n, d]
leaving the original layer l, Adam minimises the mean over tokens t of the relative squared error

    E(θ) = mean_t ‖layer_θ(h)_t − y_t‖² / ‖y_t‖²

over θ = the parameters of the layer's MLP (everything else in the layer frozen), ``epochs`` passes over the
calibration blocks in a seeded order, ``batch_blocks`` blocks per step, learning rate ``lr`` with cosine decay to 0,
optionally under bfloat16 autocast. Why: the residual gap h_T − h that the converted layers before leave is mostly
out of one attention layer's reach (the residual target's relative error stays at 0.5–0.98 after the attention
transfer at KV 0.25×, docs/results.md §13d); the MLP holds three times the attention's weights and sits on the
same residual stream. Per token, because the next layer reads each token through an RMSNorm (its scale divided
out), and because a plain squared error would be the first token's: in SmolLM2-135M's middle layers it holds 95 %
of the stream's squared norm (its massive activations). E is measured on every block before and after; if training
did not lower it the MLP's weights are put back, so the step never leaves a layer further from the original stream
on its calibration data (where the conversion is exact, the gap is rounding and stays so).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ..config.fields import AUTOCAST_DTYPES
from .calibration import LayerStream
from .mla_transfer import (AttentionBatch, adam_epochs, batch_output, relative_output_error,
                           residual_norm_weights)
from .training import autocast_to

__all__ = ["layer_batches", "transfer_mlp"]


def layer_batches(stream: LayerStream, targets: LayerStream) -> list[AttentionBatch]:
    """Per calibration batch the decoder layer's keyword arguments (``hidden_states`` [b, n, d] from ``stream``, the
    rest as captured) with ``targets``' hidden states y [b, n, d] as the output to learn, each token weighted by
    1 / ‖y_t‖², so ``relative_output_error`` is the mean over tokens of ‖out_t − y_t‖² / ‖y_t‖²."""
    if len(stream.hidden) != len(targets.hidden):
        raise ValueError(f"the streams hold {len(stream.hidden)} and {len(targets.hidden)} batches")
    batches = [AttentionBatch(dict(kwargs, hidden_states=h), y)
               for h, kwargs, y in zip(stream.hidden, stream.layer_kwargs, targets.hidden)]
    return residual_norm_weights(batches, targets.hidden)


def transfer_mlp(layer: nn.Module, mlp: nn.Module, batches: list[AttentionBatch], *, epochs: int, lr: float,
                 batch_blocks: int, seed: int = 0, dtype: str = "float32") -> dict:
    """Train ``mlp`` (a submodule of the decoder ``layer``) so that ``layer`` reproduces ``batches``' targets
    (``layer_batches``; module docstring). Returns {"error_before", "error_after", "steps", "kept", "seconds"}:
    E (``relative_output_error`` with the batches' token weights) before and after (``kept``: the trained weights
    were kept). The steps run under autocast to ``dtype`` unless "float32" (``AUTOCAST_DTYPES``; weights, Adam's
    state and the loss stay float32)."""
    if dtype not in AUTOCAST_DTYPES:
        raise ValueError(f"transfer dtype must be one of {AUTOCAST_DTYPES}, got {dtype!r}")
    if epochs < 1 or batch_blocks < 1 or lr <= 0:
        raise ValueError(f"an MLP transfer needs epochs >= 1, batch_blocks >= 1 and lr > 0; got {epochs}, "
                         f"{batch_blocks}, {lr}")
    start = time.perf_counter()
    trained = list(mlp.parameters())
    if not trained or not any(p is q for p in trained for q in layer.parameters()):
        raise ValueError("the MLP to train must be a submodule of the layer with parameters")
    pieces = [piece for batch in batches for piece in batch.split(batch_blocks)]
    initial = [p.detach().clone() for p in trained]
    before = relative_output_error(layer, batches)
    everything = list(layer.parameters())
    flags = [p.requires_grad for p in everything]
    autocast = autocast_to(dtype, trained[0].device)

    def step_loss(_index: int, piece: AttentionBatch) -> torch.Tensor:
        with autocast:
            out = batch_output(layer, piece)
        n = piece.target.shape[0] * piece.target.shape[1]
        return piece.squared_error(out.float()) / n  # the mean of ‖out_t − y_t‖² / ‖y_t‖²

    try:
        for p in everything:  # only the MLP's weights get gradients: nothing else in the layer is graphed
            p.requires_grad_(any(p is q for q in trained))
        steps = adam_epochs(trained, pieces, step_loss, epochs=epochs, lr=lr, seed=seed)
    finally:
        for p, flag in zip(everything, flags):
            p.requires_grad_(flag)
            p.grad = None
    after = relative_output_error(layer, batches)
    kept = after < before
    if not kept:
        with torch.no_grad():
            for p, value in zip(trained, initial):
                p.copy_(value)
    return {"error_before": before, "error_after": after if kept else before, "steps": steps, "kept": kept,
            "seconds": time.perf_counter() - start}
