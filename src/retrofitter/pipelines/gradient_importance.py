"""The fisher weighting's importance of each projection output: the mean squared loss gradient there.

    f_m = Σ_t ‖∂L/∂y_{m,t}‖² / (T · d'_m)      L: the summed next-token loss, y_m [T, d'_m]: projection m's output

A first-order estimate of how much an output error of matrix m costs in loss; the global allocation
(pipelines/allocation.py, ``allocation_weighting="fisher"``) prices each matrix's error spectrum by it.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.utils.checkpoint
from torch import nn

from ..eval.resources import release_free_heap_memory
from .distill import DistillationLoss
from .distributed import SINGLE_PROCESS, DataParallel

__all__ = ["output_gradient_importance"]


@contextlib.contextmanager
def _recomputed_in_backward(layers):
    """Each decoder layer of ``layers`` runs under non-reentrant activation checkpointing: its
    intermediates are recomputed in the backward pass instead of kept, so the backward holds one layer's
    activations plus the layer boundaries (a 512-token block of SmolLM2-135M: ~1.9 GB otherwise). The
    autograd graph is the one of the plain forward (recomputation only refills saved tensors), so the
    gradient hooks registered during the forward fire once, with the same values."""
    own = [layer.__dict__.get("forward") for layer in layers]  # an instance forward (accelerate hooks) stays

    def checkpointed(forward):
        return lambda *args, **kwargs: torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    for layer in layers:
        layer.forward = checkpointed(layer.forward)
    try:
        yield
    finally:
        for layer, forward in zip(layers, own):
            if forward is None:
                del layer.forward  # the class's forward again
            else:
                layer.forward = forward


def output_gradient_importance(model: nn.Module, adapter, calibration: torch.Tensor, targets: list[str],
                               n_blocks: int, parallel: DataParallel = SINGLE_PROCESS) -> dict:
    """f_m = Σ_t ‖∂L/∂y_{m,t}‖² / (T · d'_m) for every (layer index, name) in ``targets`` (module docstring).

    Backward passes (one block at a time) over the first ``n_blocks`` rows of ``calibration``
    [n, seq_len] with the summed next-token loss; weights stay frozen: only the embedding output
    requires a gradient, which is enough for every projection output to get one. With several processes
    (``parallel``) each takes every W-th of those blocks and the sums and token counts are all-reduced.
    """
    blocks = calibration[: max(1, n_blocks)][parallel.rank::parallel.world_size]
    layers = adapter.decoder_layers(model)
    sums: dict = {(index, name): 0.0 for index in range(len(layers)) for name in targets}
    tokens = 0
    handles = []

    def watch(key, d_out):
        def forward_hook(_module, _args, output):
            if output.requires_grad:
                output.register_hook(lambda grad: sums.__setitem__(
                    key, sums[key] + float(grad.detach().to(torch.float64).pow(2).sum()) / d_out))
        return forward_hook

    for index, layer in enumerate(layers):
        for name in targets:
            linear = adapter.get_linear(layer, name)
            handles.append(linear.register_forward_hook(watch((index, name), linear.out_features)))
    handles.append(adapter.input_embedding(model).register_forward_hook(
        lambda _module, _args, output: output.detach().requires_grad_(True)))
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    # Frozen weights: no weight gradient is computed or kept (it would hold a second copy of the model).
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.requires_grad_(False)
    try:
        with torch.enable_grad(), _recomputed_in_backward(layers):
            next_token_loss = DistillationLoss(model, nll_weight=1.0)  # mean NLL, LM head in position chunks
            for row in blocks:
                ids = row.unsqueeze(0).to(device)
                (next_token_loss(ids) * (ids.shape[1] - 1)).backward()  # the summed loss: never [n, V] logits at once
                tokens += ids.shape[1] - 1
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
        for p in trainable:
            p.requires_grad_(True)
        release_free_heap_memory()  # the backward's activations: back to the OS, not kept by the C heap
    if parallel.active:  # Σ over the processes' blocks: one float64 vector [keys..., tokens]
        keys = list(sums)
        totals = torch.tensor([sums[k] for k in keys] + [tokens], dtype=torch.float64, device=device)
        parallel.all_reduce_sum(totals)
        sums, tokens = dict(zip(keys, totals[:-1].tolist())), float(totals[-1])
    bad = [key for key, value in sums.items() if not math.isfinite(value)]
    if bad:
        raise FloatingPointError(f"non-finite loss gradient at the output of layer {bad[0][0]} {bad[0][1]!r}")
    return {key: value / tokens for key, value in sums.items()}
