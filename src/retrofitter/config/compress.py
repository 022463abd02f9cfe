"""``CompressConfig``: the settings every compression method shares, and the method's own options."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .fields import JsonRoundTrip, option
from .methods import COMPRESS_METHODS, MethodOptions

__all__ = ["CompressConfig", "STATISTICS", "ALLOCATIONS", "ALLOCATION_WEIGHTINGS"]

# Where layer l's statistics come from (pipelines/statistics_sources.py): the compressed model's own activations,
# the original model's, or both (teacher_target: fit W' x_c to the original output W x_t, linalg/teacher_target.py).
STATISTICS = ("compressed", "teacher", "teacher_target")
ALLOCATIONS = ("uniform", "global")
# How global rank allocation compares the error of different matrices (pipelines/allocation.py).
ALLOCATION_WEIGHTINGS = ("relative", "absolute", "sqrt_relative", "fisher")


@dataclass(frozen=True)
class CompressConfig(JsonRoundTrip):
    """Settings of ``retrofitter.compress``: the common ones below, the method's own in ``options``.

    ratio: fraction of the compressible linear parameters removed (0 < ratio < 1).
    method: one of ``COMPRESS_METHODS`` (config/methods.py); the asvd-* variants differ by preconditioner.
    options: the method's options (``COMPRESS_METHODS[method].options``, e.g. ``LatentLLMOptions``); ``None``
      (default) = that class's defaults. Every cross-field check (``options.check``) runs here, at construction.
    junction: store factors in block-identity form, r(d+d') − r² parameters instead of r(d+d').
    statistics: ``"compressed"`` — layer l is calibrated on the outputs of the already compressed
      layers < l (sequential); ``"teacher"`` — on the original model's activations; ``"teacher_target"``
      — fitted so that the compressed inputs reproduce the original's outputs (error feedback; for
      ``latentllm`` also inside the joint QK / VO and down fits).
      ``None`` (default) resolves per method (``MethodSpec.statistics``): compressed for ``latentllm``,
      teacher for the local methods (as good as sequential ones at a fraction of the cost, docs/results.md).
    damping: λ in C + λ·mean(diag C)·I.
    targets: projection names to compress (adapter names, e.g. ``q k v o gate up down``); empty = all.
    allocation: ``"uniform"`` (each matrix keeps 1 − ratio of its parameters) or ``"global"`` (one
      budget, ranks priced by ``allocation_weighting``); ``None`` (default) = global, the measured best
      for every method (benchmarks/compress_ablation.py).
    refit_within_layer: collect each projection group's statistics after the groups before it in the
      same layer were replaced (o sees the compressed q/k/v, the MLP the compressed attention) instead
      of one pass of the original layer. ``None`` (default) resolves to the setting of the measured
      figures: on for ``latentllm`` (which needs it) and for global allocation with sequential
      statistics, off for uniform allocation and for teacher statistics.
    """

    ratio: float = option(0.2, "fraction of the linear-layer parameters removed, in (0, 1)")
    method: str = option("asvd-rootcov", "compression method", choices=tuple(COMPRESS_METHODS))
    options: MethodOptions | None = None  # the method's own settings; flags from the options classes' fields
    junction: bool = option(True, "block-identity factors, r(d+d')-r^2 parameters (--no-junction: plain B, A)")
    statistics: str | None = option(None, "calibrate layer l on the compressed model's activations (compressed), "
                                     "on the original's (teacher), or fit the compressed model's inputs to the "
                                     "original's outputs (teacher_target: error feedback); default: "
                                     "teacher for the local methods, compressed for latentllm",
                                     choices=STATISTICS)
    damping: float = option(1e-2, "lambda in C + lambda*mean(diag C)*I")
    targets: tuple[str, ...] = option((), "comma-separated projections to compress (default all)")
    allocation: str | None = option(None, "uniform: every matrix keeps 1-ratio of its parameters; global: one "
                                     "budget by water-filling, ranks priced by --allocation-weighting (default)",
                                     choices=ALLOCATIONS)
    batch_size: int = option(8, "calibration batch size")
    refit_within_layer: bool | None = option(None, "statistics of each projection group after the groups before "
                                              "it in the layer were replaced (default: on for latentllm and "
                                              "global allocation)")
    allocation_weighting: str = option("fisher", "global allocation: how errors of different matrices compare "
                                        "(fisher: priced by the loss gradient at each matrix's output)",
                                        choices=ALLOCATION_WEIGHTINGS)
    allocation_min_keep: float = option(0.0, "global allocation: each matrix keeps at least this fraction")
    allocation_gradient_blocks: int = option(8, "fisher weighting: calibration blocks of the backward passes")

    def __post_init__(self):
        self._check_finite()
        if not 0.0 < self.ratio < 1.0:
            raise ValueError(f"ratio must lie in (0, 1) (fraction of linear parameters removed), got {self.ratio}")
        if self.method not in COMPRESS_METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose from {', '.join(COMPRESS_METHODS)}")
        spec = COMPRESS_METHODS[self.method]
        # frozen dataclass: the method's defaults are resolved once, here
        if self.options is None:
            object.__setattr__(self, "options", spec.options())
        elif isinstance(self.options, dict):  # from JSON
            object.__setattr__(self, "options", spec.options.from_dict(self.options))
        if type(self.options) is not spec.options:
            raise ValueError(f"--method {self.method} takes {spec.options.__name__}, got "
                             f"{type(self.options).__name__}")
        if self.statistics is None:
            object.__setattr__(self, "statistics", spec.statistics)
        self._check_choice("statistics", STATISTICS)
        if self.allocation is None:
            object.__setattr__(self, "allocation", "global")
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be 'uniform' or 'global', got {self.allocation!r}")
        if self.refit_within_layer is None:
            object.__setattr__(self, "refit_within_layer", self.options.needs_refit_within_layer or
                               (self.allocation == "global" and self.statistics != "teacher"))
        if self.allocation_weighting not in ALLOCATION_WEIGHTINGS:
            raise ValueError(f"unknown allocation weighting {self.allocation_weighting!r}; "
                             f"choose from {', '.join(ALLOCATION_WEIGHTINGS)}")
        if self.allocation_gradient_blocks < 1:
            raise ValueError(f"allocation_gradient_blocks must be >= 1, got {self.allocation_gradient_blocks}")
        if not 0.0 <= self.allocation_min_keep < 1.0 - self.ratio + 1e-12:
            raise ValueError(f"allocation_min_keep must lie in [0, 1 - ratio], got {self.allocation_min_keep}")
        if self.damping < 0:
            raise ValueError(f"damping must be >= 0, got {self.damping}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        self.options.check(self)

    @property
    def preconditioner(self) -> str:
        """The preconditioner of the local activation-aware SVD fits of this method (linalg/preconditioners.py)."""
        return COMPRESS_METHODS[self.method].preconditioner

    @classmethod
    def from_flat(cls, values: dict, *, other_defaults_ok: bool = True) -> "CompressConfig":
        """A config from one flat mapping of common and option fields (command-line flags; the flat dicts
        that retrofitter.json and results JSON held before per-method options): each option field goes to
        the method's options. Another method's option is refused by name, unless ``other_defaults_ok`` and it
        holds that option's default (the old flat dicts carried every method's fields)."""
        common = {f.name for f in dataclasses.fields(cls)}
        method = values.get("method", cls.__dataclass_fields__["method"].default)
        if method not in COMPRESS_METHODS:
            raise ValueError(f"unknown method {method!r}; choose from {', '.join(COMPRESS_METHODS)}")
        own = COMPRESS_METHODS[method].options
        own_fields = {f.name for f in dataclasses.fields(own)}
        base = dict(values.get("options") or {})
        for name, value in values.items():
            if name in common:
                continue
            if name in own_fields:
                base[name] = value
                continue
            owners = [s.options for s in COMPRESS_METHODS.values()
                      if name in {f.name for f in dataclasses.fields(s.options)}]
            if not owners:
                raise ValueError(f"unknown CompressConfig field {name!r}; known: {sorted(common | own_fields)}")
            if not other_defaults_ok or value != owners[0].__dataclass_fields__[name].default:
                methods = [m for m, s in COMPRESS_METHODS.items() if s.options is owners[0]]
                raise ValueError(f"{name} (--{name.replace('_', '-')}) is an option of --method {', '.join(methods)}, "
                                 f"not of {method} (its own: {own.__name__}, listed by `retrofitter compress --help`)")
        kept = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if k in common and k != "options"}
        return cls(**kept, options=own.from_dict(base))

    @classmethod
    def from_dict(cls, data: dict) -> "CompressConfig":
        """The inverse of ``to_dict``; also reads the flat dicts written before per-method options."""
        return cls.from_flat(data)
