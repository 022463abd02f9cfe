"""What the training stages (attention transfer, LoRA, heal) share: the ``accelerate`` set-up and the autocast dtype.

Autocast: the stages' forward and backward may run under ``torch.autocast`` to bfloat16, the weights, the optimizer
state and the losses staying float32. ``auto`` picks bfloat16 where its math is native (``eval.machine``: a CPU with
AVX512-BF16 or AMX, a CUDA device that has it) and float32 (no autocast) elsewhere: emulated bfloat16 is slower than
float32, and autocast leaves float64 and bfloat16 weights as they are.
"""

from __future__ import annotations

import torch

from ..config.fields import AUTOCAST_CHOICES, AUTOCAST_DTYPES
from ..eval.machine import native_bfloat16

__all__ = ["autocast_to", "make_accelerator", "resolve_autocast_dtype"]


def make_accelerator(device: torch.device | str = "cpu"):
    """An ``accelerate.Accelerator`` for ``device`` (CPU runs use gloo under ``torchrun``)."""
    from accelerate import Accelerator

    return Accelerator(cpu=torch.device(device).type == "cpu")


def resolve_autocast_dtype(requested: str, parameter: torch.Tensor) -> str:
    """The autocast dtype (``AUTOCAST_DTYPES``) of training a model with this ``parameter``: ``requested`` itself,
    or for "auto" "bfloat16" where the parameter is float32 on a device with native bfloat16 and "float32"
    otherwise (module docstring)."""
    if requested not in AUTOCAST_CHOICES:
        raise ValueError(f"autocast dtype must be one of {AUTOCAST_CHOICES}, got {requested!r}")
    if requested != "auto":
        return requested
    native = parameter.dtype == torch.float32 and native_bfloat16(parameter.device)
    return "bfloat16" if native else "float32"


def autocast_to(dtype: str, device: torch.device | str) -> torch.autocast:
    """The autocast context of ``dtype`` (``AUTOCAST_DTYPES``) on ``device``; disabled for "float32"."""
    if dtype not in AUTOCAST_DTYPES:
        raise ValueError(f"autocast dtype must be one of {AUTOCAST_DTYPES}, got {dtype!r}")
    return torch.autocast(torch.device(device).type, dtype=getattr(torch, dtype), enabled=dtype != "float32")
