"""Model-family wiring (the only package that knows HF model internals)."""

from .base import AttentionLayout, ModelAdapter
from .registry import (ADAPTERS, CAPABILITIES, FAMILY_ADAPTERS, UnsupportedArchitectureError, adapter_for,
                       auto_class_for, supported_architectures)

__all__ = [
    "ADAPTERS",
    "AttentionLayout",
    "CAPABILITIES",
    "FAMILY_ADAPTERS",
    "ModelAdapter",
    "UnsupportedArchitectureError",
    "adapter_for",
    "auto_class_for",
    "supported_architectures",
]
