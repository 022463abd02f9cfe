"""Permute the MLP's intermediate channels so that the down projection's junction pivots come first.

For an MLP  y = W_down · φ(W_gate x, W_up x)  (or fc2 · relu(fc1 x + b)) with an elementwise φ, and any
permutation π of the intermediate channels,

    W_down φ(W_gate x, W_up x) = (W_down P_πᵀ) φ(P_π W_gate x, P_π W_up x)

exactly. With π = [pivot_index, rest_index] of the down projection's junction form, its pivots become
channels 0..r−1: ``LatentLinear.latent`` then reads two slices of its input instead of gathering
columns (a copy of the [tokens, d_ff] intermediate per call). The producers' output rows (``up``
factor or dense weight, and bias) are permuted to match.
"""

from __future__ import annotations

import torch
from torch import nn

from ..modules.latent_linear import LatentLinear
from .registry import adapter_for

__all__ = ["lead_mlp_pivots"]


def _permute_output_rows(module: nn.Module, permutation: torch.Tensor) -> None:
    weight = module.up if isinstance(module, LatentLinear) else module.weight
    weight.data = weight.data.index_select(0, permutation.to(weight.device))
    if module.bias is not None:
        module.bias.data = module.bias.data.index_select(0, permutation.to(module.bias.device))


@torch.no_grad()
def lead_mlp_pivots(model: nn.Module, indices=None) -> int:
    """Apply the permutation (module docstring) in every layer where it applies (only the decoder layers
    ``indices`` when given); returns how many.

    It applies when the consumer (down, fc2) is a junction ``LatentLinear`` whose pivots do not lead
    yet and every producer is an ``nn.Linear`` or ``LatentLinear`` (other wrappers are left alone).
    """
    adapter = adapter_for(model)
    producers, consumer_name = adapter.mlp_intermediate()
    changed = 0
    layers = adapter.decoder_layers(model)
    for layer in (layers if indices is None else [layers[i] for i in indices]):
        consumer = adapter.get_linear(layer, consumer_name)
        if not isinstance(consumer, LatentLinear) or not consumer.junction or consumer.pivots_lead():
            continue
        modules = [adapter.get_linear(layer, name) for name in producers]
        if not all(type(m) in (nn.Linear, LatentLinear) for m in modules):
            continue
        permutation = torch.cat([consumer.pivot_index, consumer.rest_index])
        for module in modules:
            _permute_output_rows(module, permutation)
        consumer.pivot_index.copy_(torch.arange(consumer.rank, device=consumer.pivot_index.device))
        consumer.rest_index.copy_(torch.arange(consumer.rank, consumer.in_features, device=consumer.rest_index.device))
        consumer.refresh_layout()
        changed += 1
    return changed
