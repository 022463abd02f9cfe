"""retrofitter: convert a pretrained Transformer LM into a cheaper architecture without pre-training.

Public API (lazy, so ``import retrofitter`` stays cheap):
``compress``, ``convert_to_mla``, ``linearize``, ``heal``, ``export``, ``evaluate``, ``quantize``, ``load``, ``save``,
``load_model``, ``load_tokenizer``, ``CompressConfig``,
``LinearizeConfig``, ``HealConfig``, ``MLAConfig``.
"""

from .version import __version__

__all__ = ["__version__", "compress", "convert_to_mla", "linearize", "heal", "export", "evaluate", "quantize", "load", "save",
           "load_model", "load_tokenizer",
           "CompressConfig", "LinearizeConfig", "HealConfig", "EvalConfig", "MLAConfig"]

_API_NAMES = {"compress", "convert_to_mla", "linearize", "heal", "export", "evaluate", "quantize", "load", "save", "load_model",
              "load_tokenizer"}
_CONFIG_NAMES = {"CompressConfig", "LinearizeConfig", "HealConfig", "EvalConfig"}


def __getattr__(name):
    if name in _API_NAMES:
        from . import api

        return getattr(api, name)
    if name == "MLAConfig":  # registered next to its pipeline
        from .pipelines.mla import MLAConfig

        return MLAConfig
    if name in _CONFIG_NAMES:
        from . import config

        return getattr(config, name)
    raise AttributeError(f"module 'retrofitter' has no attribute {name!r}")
