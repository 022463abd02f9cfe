"""Compression methods: one options class per method family, its method names in its class line.

Adding a compression method touches three places (docs/design.md, "Adding a compression method"):

1. an options class here, ``class MyOptions(MethodOptions, methods={"my-method": "rootcov"})``: its own
   settings as ``option`` fields (they become ``compress --flags``), the preconditioner of each method
   name it serves, and ``check(config)``: its cross-field checks against the common ``CompressConfig``,
   run when that is built;
2. a strategy file in ``pipelines/`` (a ``LayerStrategy``: ``fit_layer(context)``, ``finish(model, targets)``);
3. one line in ``pipelines.compress.STRATEGIES``: options class -> strategy factory.

``COMPRESS_METHODS`` (method name -> ``MethodSpec``) is filled by the class statements themselves
(``MethodOptions.__init_subclass__``): the class line is the registration.

The loop and the rank allocation read a few settings of every method through its options
(``kv_ratio``, ``factor_forms``, ``budget``, ``latency_tokens``); a method without such a setting has the
neutral value of ``MethodOptions`` (no latent cache budget, junction factors, a parameter budget).
"""

from __future__ import annotations

from dataclasses import dataclass

from .fields import JsonRoundTrip, option

__all__ = ["MethodSpec", "MethodOptions", "LocalSVDOptions", "LatentLLMOptions", "COMPRESS_METHODS", "DOWN_FITS",
           "MLP_ALGORITHMS", "FACTOR_FORM_CHOICES", "BUDGETS"]


@dataclass(frozen=True)
class MethodSpec:
    """What ``CompressConfig`` needs of one method name: its options class, the preconditioner of its local
    activation-aware SVD fits (design.md §3, the paper's Table 1) and its default ``statistics``."""

    options: type
    preconditioner: str
    statistics: str = "teacher"


# method name -> MethodSpec, in registration order (filled by the options classes' class statements)
COMPRESS_METHODS: dict[str, MethodSpec] = {}

DOWN_FITS = ("anchored", "ridge", "select")  # latentllm joint MLP: pipelines/latentllm.py
MLP_ALGORITHMS = ("streaming", "auxiliary")
# How each factored matrix runs (pipelines/form_choice.py) and what the global allocation prices (issue 15).
FACTOR_FORM_CHOICES = ("junction", "fastest")
BUDGETS = ("params", "latency")


class MethodOptions(JsonRoundTrip):
    """Base of the per-method options (module docstring). Subclasses are frozen dataclasses.

    The class attributes below are the neutral values of the settings the loop reads of every method;
    an options class that has the setting declares it as a field."""

    kv_ratio: float | None = None  # latent k/v cache budget of the global allocation (None: none)
    factor_forms = "junction"      # how factored matrices run (pipelines/form_choice.py)
    budget = "params"              # what the global allocation prices
    latency_tokens = 512           # prefill length of the latency cost model
    needs_refit_within_layer = False  # the method's fits need each group's statistics after the groups before it

    def __init_subclass__(cls, methods: dict[str, str] | None = None, statistics: str = "teacher", **kwargs):
        super().__init_subclass__(**kwargs)
        for name, preconditioner in (methods or {}).items():
            if name in COMPRESS_METHODS:
                raise ValueError(f"compression method {name!r} is registered twice "
                                 f"({COMPRESS_METHODS[name].options.__name__} and {cls.__name__})")
            COMPRESS_METHODS[name] = MethodSpec(cls, preconditioner, statistics)

    def check(self, config) -> None:
        """Cross-field checks against the common settings of ``config`` (the ``CompressConfig`` being built, which
        imports this module); none by default."""


@dataclass(frozen=True)
class LocalSVDOptions(MethodOptions, methods={"svd": "plain", "asvd-hessian": "hessian", "asvd-l2": "l2",
                                              "asvd-cov": "cov", "asvd-rootcov": "rootcov", "svd-llm": "cholesky"}):
    """Options of the local methods (svd, asvd-*, svd-llm): each projection gets its own activation-aware
    SVD, the preconditioner named by the method (pipelines/local_svd.py)."""

    factor_forms: str = option("junction", "how each factored matrix runs: junction (the --junction/--no-junction "
                                "form, for every matrix) or fastest (the fastest allowed form by a cost model timed "
                                "on this machine, eval/form_cost.py)", choices=FACTOR_FORM_CHOICES)
    budget: str = option("params", "global allocation priced in stored parameters (params) or in modelled "
                          "prefill time (latency: the time of the uniform plan at --ratio; matrices that run "
                          "faster dense stay dense)", choices=BUDGETS)
    latency_tokens: int = option(512, "tokens of the prefill whose time the cost model predicts (--budget latency, "
                                  "--factor-forms fastest)")

    def __post_init__(self):
        self._check_choice("factor_forms", FACTOR_FORM_CHOICES)
        self._check_choice("budget", BUDGETS)
        if self.latency_tokens < 1:
            raise ValueError(f"latency_tokens must be >= 1, got {self.latency_tokens}")

    def check(self, config) -> None:
        if self.budget == "latency" and config.allocation != "global":
            raise ValueError("--budget latency prices the global allocation's rank steps: use --allocation global")


@dataclass(frozen=True)
class LatentLLMOptions(MethodOptions, methods={"latentllm": "rootcov"}, statistics="compressed"):
    """Options of LatentLLM (pipelines/latentllm.py): which joint decompositions run, their iterations, the
    joint MLP's down fit and the latent k/v cache (its budget ``kv_ratio`` and ``latent_attention``)."""

    needs_refit_within_layer = True  # its joint fits read the outputs of the already replaced groups

    joint_qk: bool = option(True, "latentllm: joint QK (Tucker) decomposition")
    joint_vo: bool = option(False, "latentllm: joint VO decomposition")
    joint_mlp: bool = option(True, "latentllm: down projection refitted to the compressed MLP intermediate")
    down_fit: str = option("anchored", "latentllm joint MLP: how down is fitted to the compressed intermediate: "
                            "anchored (damping pulls the map towards W_d), ridge (towards zero, the paper's "
                            "regression), select (per layer, anchored or local rootcov, whichever has the "
                            "smaller error on held-out calibration batches)", choices=DOWN_FITS)
    qk_iterations: int = option(8, "latentllm: joint QK alternating eigen-updates")
    vo_iterations: int = option(8, "latentllm: joint VO alternating eigen-updates")
    mlp_algorithm: str = option("streaming", "latentllm: joint MLP algorithm", choices=MLP_ALGORITHMS)
    mlp_iterations: int = option(4, "latentllm auxiliary MLP: iterations")
    mlp_aux_tokens: int = option(8192, "latentllm auxiliary MLP: token subsample (it holds activations)")
    latent_attention: bool = option(True, "latentllm: latent k/v cache (--no-latent-attention: HF attention over "
                                     "factored projections)")
    kv_ratio: float | None = option(None, "latentllm, global allocation: the latent k/v widths cache at most this "
                                     "fraction of the original's k/v numbers per token (second budget, solved with "
                                     "the first)")

    def __post_init__(self):
        self._check_finite()
        self._check_choice("down_fit", DOWN_FITS)
        self._check_choice("mlp_algorithm", MLP_ALGORITHMS)
        for name in ("qk_iterations", "vo_iterations", "mlp_iterations", "mlp_aux_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_ratio is not None and not 0.0 < self.kv_ratio <= 1.0:
            raise ValueError(f"kv_ratio must lie in (0, 1], got {self.kv_ratio}")

    def check(self, config) -> None:
        if not config.refit_within_layer:
            raise ValueError("latentllm fits each projection group on the outputs of the groups before it: "
                             "refit_within_layer must be on")
        if self.mlp_algorithm == "auxiliary" and config.statistics == "teacher_target":
            raise ValueError("mlp_algorithm='auxiliary' fits the compressed model's own MLP inputs; "
                             "statistics='teacher_target' needs the default --mlp-algorithm streaming")
        if self.kv_ratio is None:
            return
        if config.allocation != "global":
            raise ValueError("kv_ratio (--kv-ratio) is a budget of the global allocation: use --allocation global "
                             "(the default)")
        if config.targets and not {"k", "v"} <= set(config.targets):
            raise ValueError(f"kv_ratio (--kv-ratio) bounds the latent k/v cache: --targets must include k and v, "
                             f"got {','.join(config.targets)}")
