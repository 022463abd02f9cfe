"""Frozen configuration dataclasses with a JSON round trip (``to_dict`` / ``from_dict``), one file per command.

compress: ``CompressConfig`` (common settings) + one options class per method (methods.py); linearize:
``LinearizeConfig`` and its presets; heal: ``HealConfig``; sample: ``SampleConfig``; evaluation: ``EvalConfig``. ``option`` gives a
field the help text of its command-line flag (cli/flags.py generates the flags from the fields).
"""

from .compress import ALLOCATION_WEIGHTINGS, ALLOCATIONS, STATISTICS, CompressConfig
from .evaluate import EvalConfig
from .fields import (COMPRESS_CALIB_SAMPLES, DEMO_CALIB_SAMPLES, DEMO_MAX_EVAL_TOKENS, MLA_CALIB_SAMPLES, MLA_SEQ_LEN,
                     SHARDING_MODES,
                     JsonRoundTrip, option)
from .heal import HealConfig
from .linearize import LINEARIZE_PRESETS, LORA_LOSSES, LinearizeConfig
from .sample import SampleConfig
from .methods import (BUDGETS, COMPRESS_METHODS, DOWN_FITS, FACTOR_FORM_CHOICES, MLP_ALGORITHMS, LatentLLMOptions,
                      LocalSVDOptions, MethodOptions, MethodSpec)

__all__ = ["COMPRESS_CALIB_SAMPLES", "MLA_CALIB_SAMPLES", "MLA_SEQ_LEN", "DEMO_CALIB_SAMPLES", "DEMO_MAX_EVAL_TOKENS",
           "CompressConfig", "LinearizeConfig", "SampleConfig", "EvalConfig", "HealConfig", "COMPRESS_METHODS", "MethodSpec",
           "MethodOptions", "LocalSVDOptions", "LatentLLMOptions", "LINEARIZE_PRESETS", "LORA_LOSSES",
           "SHARDING_MODES", "STATISTICS", "ALLOCATIONS", "ALLOCATION_WEIGHTINGS", "DOWN_FITS", "MLP_ALGORITHMS",
           "FACTOR_FORM_CHOICES", "BUDGETS", "option", "JsonRoundTrip"]
