"""Data-parallel calibration on ``torch.distributed`` (``torchrun --nproc_per_node N -m retrofitter ...``).

Every process holds the same model (or the same layer, out of core) and its own contiguous share of
the calibration batches (:meth:`DataParallel.shard`). Per decoder layer:

    statistics  each process accumulates Σ w x, Σ w x xᵀ, Σ w over its blocks, then all-reduce (sum):
                every process holds the moments of all blocks (linalg/moments.py ``synchronize``)
    fits        the layer's matrices are spread round-robin over the processes (:meth:`owner`); each
                fits its own, then every replacement is broadcast from its owner (:func:`share_replacement`)
    check       the layer's tensors are broadcast from rank 0, so every process continues with
                bit-identical weights whatever its BLAS did (:meth:`broadcast_module`)

The batches of the single-process run are kept whole (a process takes whole batches), so every
activation is computed on the same batch as in one process: the result differs from one process only
by the order of the float64 additions of the all-reduce. Backend: gloo on CPU, NCCL on CUDA, chosen from
the device (:func:`data_parallel_from_env`); rank 0 writes the output.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["DataParallel", "SINGLE_PROCESS", "data_parallel_from_env", "backend_for", "share_replacement"]


def backend_for(device: torch.device | str) -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@dataclass(frozen=True)
class DataParallel:
    """This process's place among ``world_size`` calibration processes (rank 0 of 1: a plain run)."""

    rank: int = 0
    world_size: int = 1

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place over the processes (nothing to do for one process)."""
        if self.active:
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)

    def shard(self, blocks: torch.Tensor, batch_size: int) -> torch.Tensor:
        """This process's contiguous share of ``blocks`` [n, seq_len], in whole batches of ``batch_size``:
        batches b·⌈n_b/W⌉ .. (b+1)·⌈n_b/W⌉ − 1 for rank b of W, n_b = ⌈n / batch_size⌉ batches."""
        if not self.active:
            return blocks
        batches = math.ceil(blocks.shape[0] / batch_size)
        if batches < self.world_size:
            raise ValueError(f"{blocks.shape[0]} calibration blocks make {batches} batches of {batch_size}, fewer "
                             f"than the {self.world_size} processes: give at least {self.world_size * batch_size} "
                             f"blocks (--calib-samples) or a smaller --batch-size")
        per_rank = math.ceil(batches / self.world_size)
        start = self.rank * per_rank * batch_size
        return blocks[start:start + per_rank * batch_size]

    def owner(self, position: int) -> int:
        """The process that fits the ``position``-th piece of work (round-robin)."""
        return position % self.world_size

    def broadcast_object(self, value, src: int):
        """``value`` of process ``src`` on every process (pickled; for small metadata only)."""
        if not self.active:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        """Wait until every process got here."""
        if self.active:
            torch.distributed.barrier()

    @torch.no_grad()
    def broadcast_module(self, module: nn.Module, src: int = 0) -> None:
        """Every tensor of ``module``'s state dict overwritten in place by process ``src``'s."""
        if self.active:
            for tensor in module.state_dict().values():
                torch.distributed.broadcast(tensor, src=src)


SINGLE_PROCESS = DataParallel()


def data_parallel_from_env(device: torch.device | str = "cpu") -> DataParallel:
    """The process group of a ``torchrun`` launch (``WORLD_SIZE`` > 1 in the environment), initialised here
    with gloo (CPU) or NCCL (CUDA; each process on GPU ``LOCAL_RANK``); ``SINGLE_PROCESS`` otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return SINGLE_PROCESS
    if not torch.distributed.is_initialized():
        backend = backend_for(device)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(backend=backend)
    return DataParallel(torch.distributed.get_rank(), torch.distributed.get_world_size())


@torch.no_grad()
def share_replacement(parallel: DataParallel, owner: int, module: nn.Module | None, entry: dict | None,
                      build) -> tuple[nn.Module, dict]:
    """Process ``owner``'s fitted ``module`` and report ``entry`` on every process.

    The owner sends the entry and the state dict's names, shapes and dtypes (pickled), then each tensor
    (``broadcast``: NCCL moves device tensors directly); the others build an empty module with
    ``build(entry)`` and load the received tensors into it. Returns ``(module, entry)``.
    """
    if not parallel.active:
        return module, entry
    mine = parallel.rank == owner
    layout = [(k, tuple(t.shape), t.dtype) for k, t in module.state_dict().items()] if mine else None
    entry, layout = parallel.broadcast_object((entry, layout), src=owner)
    if not mine:
        module = build(entry)
    state = module.state_dict()
    received = {}
    for key, shape, dtype in layout:
        tensor = state[key].contiguous() if mine else torch.empty(shape, dtype=dtype, device=state[key].device)
        torch.distributed.broadcast(tensor, src=owner)
        received[key] = tensor
    if not mine:
        module.load_state_dict(received)
    return module, entry
