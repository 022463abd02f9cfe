"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for the LoRA training stages (heal, LoLCATs stage 2).

With W processes every parameter P of the student [n_0, ...] is stored as a DTensor sharded on dim 0:
process p holds rows p·⌈n_0/W⌉ … (torch.chunk). ``fully_shard`` is applied to every decoder layer,
then to the root (the training objective, whose own parameters are the embeddings, the final norm
and the LM head, tied or not): each layer's weights are all-gathered just before its forward (and
again in backward), freed after, and the gradients of its trainable tensors are reduce-scattered
(averaged over processes, as DDP averages them). The root group is not freed between forward and
backward.

LoRA stays a ``torch.nn.utils.parametrize`` parametrization (``modules.low_rank_delta``): the frozen
tensor ``parametrizations.<t>.original`` and the factors ``parametrizations.<t>.0.lora_A/B.weight`` are
ordinary parameters of the layer, so they are sharded with it; the parametrization is evaluated inside
the layer's forward, after the all-gather, on full tensors. One FSDP group holds frozen and trainable
tensors (FSDP2 allows mixed ``requires_grad``; frozen ones get no gradient and no reduce-scatter).

``fully_shard`` changes the module in place (class and parameters) and has no inverse, so
:func:`meta_skeleton` copies the module tree beforehand with every parameter on the meta device (no
memory), and :func:`gather_into` fills it afterwards with the full tensors (``DTensor.full_tensor()``,
an all-gather every process joins): the merge then runs on an ordinary module.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..adapters import adapter_for

__all__ = ["device_mesh", "shard_for_training", "meta_skeleton", "gather_into", "full_tensor", "shard_like",
           "local_numel"]


def device_mesh(device: torch.device | str, world: int):
    """The 1-D mesh of ``world`` processes on ``device``'s type (``cpu``: gloo, ``cuda``: NCCL)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(torch.device(device).type, (world,))


def shard_for_training(root: nn.Module, model: nn.Module, mesh) -> None:
    """``fully_shard`` every decoder layer of ``model`` (a submodule of ``root``), then ``root``."""
    from torch.distributed.fsdp import fully_shard

    for layer in adapter_for(model).decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(root, mesh=mesh)


def meta_skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters live on the meta device (buffers copied, ties kept)."""
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()}
    return copy.deepcopy(model, memo)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded DTensor (an all-gather: every process must call), else the tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_numel(tensor: torch.Tensor) -> int:
    """Elements this process stores: the local shard of a DTensor, else the whole tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local().numel() if isinstance(tensor, DTensor) else tensor.numel()


def shard_like(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``tensor`` (the whole value, the same on every process) laid out as the DTensor ``like``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return tensor
    return distribute_tensor(tensor.to(like.device, like.dtype), like.device_mesh, like.placements)


def gather_into(skeleton: nn.Module, sharded: nn.Module) -> nn.Module:
    """Fill ``skeleton`` (from :func:`meta_skeleton` of the module before sharding) with ``sharded``'s full
    parameters, in place; every process calls it (one all-gather per parameter) and gets the whole model."""
    full = {name: full_tensor(p.detach()) for name, p in sharded.named_parameters()}
    slots = dict(skeleton.named_parameters())
    if set(slots) != set(full):
        raise ValueError(f"the sharded model's parameters do not match its skeleton: "
                         f"{sorted(set(slots) ^ set(full))[:3]}")
    replacement = {id(slots[name]): nn.Parameter(value, requires_grad=slots[name].requires_grad)
                   for name, value in full.items()}
    for module in skeleton.modules():
        for key, p in module._parameters.items():
            if p is not None and id(p) in replacement:
                module._parameters[key] = replacement[id(p)]  # every alias of a tied tensor gets the same one
    return skeleton
