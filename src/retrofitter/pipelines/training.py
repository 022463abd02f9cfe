"""What the training stages (attention transfer, LoRA) share: the ``accelerate`` set-up."""

from __future__ import annotations

import torch

__all__ = ["make_accelerator"]


def make_accelerator(device: torch.device | str = "cpu"):
    """An ``accelerate.Accelerator`` for ``device`` (CPU runs use gloo under ``torchrun``)."""
    from accelerate import Accelerator

    return Accelerator(cpu=torch.device(device).type == "cpu")
