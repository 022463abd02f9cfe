"""Explicit registry: HF causal-LM class name -> adapter."""

from __future__ import annotations

from torch import nn

from .base import ModelAdapter
from .llama import LLAMA_FAMILY_ADAPTER, LLAMA_FAMILY_CLASSES
from .opt import OPT_ADAPTER, OPT_CLASSES

__all__ = ["ADAPTERS", "adapter_for", "UnsupportedArchitectureError", "supported_architectures"]

ADAPTERS: dict[str, ModelAdapter] = {
    **{name: LLAMA_FAMILY_ADAPTER for name in LLAMA_FAMILY_CLASSES},
    **{name: OPT_ADAPTER for name in OPT_CLASSES},
}


class UnsupportedArchitectureError(ValueError):
    """The model's class has no adapter."""


def supported_architectures() -> list[str]:
    return sorted(ADAPTERS)


def adapter_for(model: nn.Module) -> ModelAdapter:
    """The adapter for ``model`` (an HF causal LM, possibly already retrofitted)."""
    name = type(model).__name__
    if name not in ADAPTERS:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {name!r}; supported: {', '.join(supported_architectures())}"
        )
    return ADAPTERS[name]
