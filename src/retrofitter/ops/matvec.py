"""A linear map of a few rows as a broadcast multiply and a sum, for ``torch.compile``d CPU decode steps.

A decode step at batch b computes y = x Wᵀ + b for x [b, d] with b small: a matrix-vector product per row, which
reads each weight W [d_out, d] once. Written as

    y[..., j] = Σ_k x[..., k] · W[j, k]          (x [..., d] → y [..., d_out])

with a broadcast multiply and a sum over k, inductor fuses it into one vectorised reduction kernel that streams W.
On 2 AMD EPYC cores (benchmarks/matvec_bandwidth.py, random weights of SmolLM2-135M's projection shapes) that
kernel reads one row's weights at 25–35 GB/s where ``F.linear`` (MKL's sgemv) reads them at 11–17 GB/s, float32 and
bfloat16 alike; for 4 rows in bfloat16 MKL is the faster (12–15 against 9–11 GB/s), so whether it pays is measured,
not assumed (``eval.decode_loop.choose_matvec``). Run eagerly the same expression would materialise
x ⊙ W [..., d_out, d]: ``ReductionMatvec`` therefore routes only while ``torch.compile`` traces.

Reference: ``F.linear`` itself; tests/ops/test_matvec.py compares them in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["ReductionMatvec", "is_plain_float", "matvec_reduction", "plain_float_linear"]


def matvec_reduction(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as Σ_k x[..., k] · weight[j, k] (+ bias[j]): x [..., d], weight [d_out, d]."""
    out = (x.unsqueeze(-2) * weight).sum(-1)                                 # [..., d_out]
    return out if bias is None else out + bias


def is_plain_float(tensor) -> bool:
    """A plain floating tensor or parameter (not a quantized or otherwise wrapped subclass)."""
    return type(tensor) in (torch.Tensor, nn.Parameter) and tensor.is_floating_point()


def plain_float_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` itself (not a subclass or wrapper) whose weight ``is_plain_float``: its weight is the map."""
    return type(module) is nn.Linear and is_plain_float(module.weight)


class ReductionMatvec(TorchFunctionMode):
    """While active under ``torch.compile`` tracing, ``F.linear(x, W, b)`` with at most ``max_rows`` input rows
    (x.numel() / d), on CPU, with a plain floating weight of x's dtype, runs as ``matvec_reduction``; every other
    call (more rows, another device, a quantized weight, eager execution) runs ``F.linear`` unchanged."""

    def __init__(self, max_rows: int = 1):
        super().__init__()
        if int(max_rows) < 1:
            raise ValueError(f"ReductionMatvec needs max_rows >= 1; got {max_rows}")
        self.max_rows = int(max_rows)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.compiler.is_compiling():
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (x.device.type == "cpu" and x.shape[:-1].numel() <= self.max_rows and is_plain_float(weight)
                    and weight.dtype == x.dtype and (bias is None or is_plain_float(bias))):
                return matvec_reduction(x, weight, bias)
        return func(*args, **kwargs)
