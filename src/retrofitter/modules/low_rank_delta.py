"""LoRA as a parametrization of any weight tensor, merged back exactly.

For a tensor W [out, in] (an ``nn.Linear`` weight, or a factor of a ``LatentLinear``: ``up`` [d', r],
``mix`` [r, d − r], ``down`` [r, d]) the adapted tensor is

    W' = W + s · B A,   A [k, in] (kaiming-uniform), B [out, k] (zeros at start),   s = α / k

(PEFT's initialisation and names: ``lora_A.weight``, ``lora_B.weight``). It is registered with
``torch.nn.utils.parametrize``, so *every* reader of the tensor sees W' — ``F.linear`` in the module's
own forward as well as modules that read a factor directly (``LatentAttention`` reads ``up`` of its
k/v projections); module types, attribute names and shapes stay as they are.

Merging (:func:`merge_low_rank_deltas`) stores W' computed once, with the same operations as the
forward pass, in place of W: the merged model equals the adapter model exactly. A factor of a
``LatentLinear`` keeps its shape, so the rank r does not grow: LoRA on ``up`` and on ``mix`` keeps
the junction form z = x[piv] + mix' x[rest], y = up' z (the pivot columns stay the identity), and
the saved layout (keys ``up``, ``mix``, ``pivot_index``, ``rest_index``) is unchanged.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.utils import parametrize

__all__ = ["LowRankDelta", "add_low_rank_delta", "low_rank_deltas", "merge_low_rank_deltas",
           "low_rank_delta_state", "load_low_rank_delta_state"]


class LowRankDelta(nn.Module):
    """Parametrization W ↦ W + (α / k) · B A of a tensor W [out, in]."""

    def __init__(self, out_features: int, in_features: int, rank: int, alpha: float,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.rank, self.alpha = int(rank), float(alpha)
        self.scaling = self.alpha / self.rank
        self.lora_A = nn.Linear(in_features, rank, bias=False, dtype=dtype, device=device)  # A [k, in]
        self.lora_B = nn.Linear(rank, out_features, bias=False, dtype=dtype, device=device)  # B [out, k]
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def delta(self) -> torch.Tensor:
        """s · B A  [out, in]."""
        return self.scaling * (self.lora_B.weight @ self.lora_A.weight)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.delta()


def add_low_rank_delta(module: nn.Module, tensor_name: str, rank: int, alpha: float) -> LowRankDelta:
    """Adapt ``module.<tensor_name>`` (a 2-D parameter, frozen) with a ``LowRankDelta``; returns it."""
    weight = getattr(module, tensor_name)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        raise ValueError(f"LoRA needs a 2-D tensor; {type(module).__name__}.{tensor_name} is "
                         f"{getattr(weight, 'shape', type(weight).__name__)}")
    if parametrize.is_parametrized(module, tensor_name):
        raise ValueError(f"{type(module).__name__}.{tensor_name} already carries a parametrization")
    weight.requires_grad_(False)
    delta = LowRankDelta(weight.shape[0], weight.shape[1], rank, alpha, dtype=weight.dtype, device=weight.device)
    parametrize.register_parametrization(module, tensor_name, delta)
    return delta


def low_rank_deltas(model: nn.Module) -> dict[str, LowRankDelta]:
    """``"<module path>.<tensor name>"`` -> its ``LowRankDelta``, in module order."""
    found = {}
    for path, module in model.named_modules():
        if not parametrize.is_parametrized(module):
            continue
        for tensor_name, chain in module.parametrizations.items():
            for parametrization in chain:
                if isinstance(parametrization, LowRankDelta):
                    found[f"{path}.{tensor_name}" if path else tensor_name] = parametrization
    return found


def merge_low_rank_deltas(model: nn.Module) -> int:
    """Store W + s·BA in place of every adapted W and remove the parametrizations; returns how many.

    ``leave_parametrized=True`` evaluates the chain once (the forward pass's own expression) and
    writes the result into the original parameter, so the merged model computes what the adapter
    model computed."""
    merged = 0
    for module in list(model.modules()):
        if not parametrize.is_parametrized(module):
            continue
        for tensor_name in list(module.parametrizations):
            if any(isinstance(p, LowRankDelta) for p in module.parametrizations[tensor_name]):
                with torch.no_grad():
                    parametrize.remove_parametrizations(module, tensor_name, leave_parametrized=True)
                getattr(module, tensor_name).requires_grad_(False)
                merged += 1
    return merged


def low_rank_delta_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA factors alone: ``"<path>.<tensor>.lora_A"`` [k, in] and ``".lora_B"`` [out, k] (for resuming)."""
    state = {}
    for name, delta in low_rank_deltas(model).items():
        state[f"{name}.lora_A"] = delta.lora_A.weight.detach()
        state[f"{name}.lora_B"] = delta.lora_B.weight.detach()
    return state


def load_low_rank_delta_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy factors saved by :func:`low_rank_delta_state` into the model's deltas (same targets required)."""
    deltas = low_rank_deltas(model)
    expected = {f"{name}.lora_{part}" for name in deltas for part in "AB"}
    if set(state) != expected:
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(f"saved LoRA factors do not match the adapted tensors; missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    with torch.no_grad():
        for name, delta in deltas.items():
            delta.lora_A.weight.copy_(state[f"{name}.lora_A"])
            delta.lora_B.weight.copy_(state[f"{name}.lora_B"])
