"""retrofitter: convert a pretrained Transformer LM into a cheaper architecture without pre-training.

Public API (lazy, so ``import retrofitter`` stays cheap):
``compress``, ``linearize``, ``heal``, ``evaluate``, ``quantize``, ``load``, ``save``, ``CompressConfig``,
``LinearizeConfig``, ``HealConfig``.
"""

from .version import __version__

__all__ = ["__version__", "compress", "linearize", "heal", "evaluate", "quantize", "load", "save", "load_model",
           "CompressConfig", "LinearizeConfig", "HealConfig", "EvalConfig"]

_API_NAMES = {"compress", "linearize", "heal", "evaluate", "quantize", "load", "save", "load_model"}
_CONFIG_NAMES = {"CompressConfig", "LinearizeConfig", "HealConfig", "EvalConfig"}


def __getattr__(name):
    if name in _API_NAMES:
        from . import api

        return getattr(api, name)
    if name in _CONFIG_NAMES:
        from . import config

        return getattr(config, name)
    raise AttributeError(f"module 'retrofitter' has no attribute {name!r}")
