"""Explicit registry: HF causal-LM class name -> adapter.

``FAMILY_ADAPTERS`` lists one ``ModelAdapter`` per family; each names the HF classes it serves in
``architectures``, and ``ADAPTERS`` indexes them by class name. Capability questions ("which
architectures can be linearized?") are answered from the adapters' flags. ``auto_class_for(config)``
says which transformers Auto class builds a model of a config (``AutoModelForCausalLM`` for causal LMs,
the adapter's ``auto_class`` for composite models such as LLaVA).
"""

from __future__ import annotations

from torch import nn

from .base import ModelAdapter, UnsupportedArchitectureError
from .gemma import GEMMA2_ADAPTER, GEMMA3_ADAPTER
from .gpt_neox import GPT_NEOX_ADAPTER
from .llama import LLAMA_ADAPTER
from .llava import LLAVA_ADAPTER
from .opt import OPT_ADAPTER
from .phi3 import PHI3_ADAPTER
from .qwen2 import QWEN2_ADAPTER

__all__ = ["ADAPTERS", "FAMILY_ADAPTERS", "CAPABILITIES", "adapter_for", "UnsupportedArchitectureError",
           "supported_architectures", "auto_class_for"]

FAMILY_ADAPTERS: tuple[ModelAdapter, ...] = (LLAMA_ADAPTER, QWEN2_ADAPTER, OPT_ADAPTER, GEMMA2_ADAPTER,
                                              GEMMA3_ADAPTER, PHI3_ADAPTER, GPT_NEOX_ADAPTER, LLAVA_ADAPTER)

ADAPTERS: dict[str, ModelAdapter] = {name: adapter for adapter in FAMILY_ADAPTERS for name in adapter.architectures}

# Capability name -> the ModelAdapter flag that grants it (for supported_architectures(capability)).
CAPABILITIES: dict[str, str] = {
    "linearize": "linearizable",
    "latent_attention": "latent_attention",
}


def supported_architectures(capability: str | None = None) -> list[str]:
    """Sorted HF class names with an adapter (and, given ``capability`` in ``CAPABILITIES``, that flag)."""
    if capability is None:
        return sorted(ADAPTERS)
    if capability not in CAPABILITIES:
        raise ValueError(f"unknown capability {capability!r}; choose one of {sorted(CAPABILITIES)}")
    flag = CAPABILITIES[capability]
    return sorted(name for name, adapter in ADAPTERS.items() if getattr(adapter, flag))


def adapter_for(model: nn.Module, capability: str | None = None) -> ModelAdapter:
    """The adapter for ``model`` (an HF causal LM, possibly already retrofitted).

    With ``capability`` (a key of ``CAPABILITIES``), also require that the adapter supports it.
    Errors name the supported architectures.
    """
    name = type(model).__name__
    if name not in ADAPTERS:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {name!r}; supported: {', '.join(supported_architectures())}"
        )
    adapter = ADAPTERS[name]
    if capability is not None and name not in supported_architectures(capability):
        raise UnsupportedArchitectureError(
            f"{capability} is not supported for {name} (family {adapter.family!r}); "
            f"supported architectures: {', '.join(supported_architectures(capability))}"
        )
    return adapter


def auto_class_for(config) -> type:
    """The transformers Auto class that builds a model of ``config`` (an HF config): the ``auto_class`` of the
    adapter serving ``config.architectures``, ``AutoModelForCausalLM`` for any other architecture."""
    import transformers

    names = getattr(config, "architectures", None) or ()
    name = next((ADAPTERS[n].auto_class for n in names if n in ADAPTERS), "AutoModelForCausalLM")
    return getattr(transformers, name)
