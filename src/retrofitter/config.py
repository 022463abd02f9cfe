"""Frozen configuration dataclasses with a JSON round trip (``to_dict`` / ``from_dict``)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

__all__ = ["COMPRESS_CALIB_SAMPLES", "MLA_CALIB_SAMPLES", "DEMO_CALIB_SAMPLES", "DEMO_MAX_EVAL_TOKENS", "CompressConfig", "LinearizeConfig", "EvalConfig", "COMPRESS_METHODS", "HealConfig", "LORA_LOSSES",
           "SHARDING_MODES", "option", "JsonRoundTrip"]

# compress --method -> preconditioner of the local activation-aware SVD (design.md §3, paper Table 1)
COMPRESS_METHODS: dict[str, str] = {
    "svd": "plain",
    "asvd-hessian": "hessian",
    "asvd-l2": "l2",
    "asvd-cov": "cov",
    "asvd-rootcov": "rootcov",
    "svd-llm": "cholesky",
    "latentllm": "rootcov",
}

# Where layer l's statistics come from (pipelines/sequential.py): the compressed model's own activations,
# the original model's, or both (teacher_target: fit W' x_c to the original output W x_t, linalg/teacher_target.py).
STATISTICS = ("compressed", "teacher", "teacher_target")
DOWN_FITS = ("anchored", "ridge", "select")  # latentllm joint MLP: pipelines/latentllm.py

# LoLCATs stage 2 objective: KL to the original model's next-token distribution (pipelines/heal.py), or next-token NLL.
LORA_LOSSES = ("kl", "next_token")
# Calibration and evaluation defaults shared by the CLI and the job functions (written once)
COMPRESS_CALIB_SAMPLES = 64  # blocks of 512 tokens for compress
MLA_CALIB_SAMPLES = 32       # blocks of 512 tokens for mla
DEMO_CALIB_SAMPLES = 32
DEMO_MAX_EVAL_TOKENS = 4096
SHARDING_MODES = ("ddp", "fsdp")  # training stages under several processes (pipelines/sharding.py)

# How each factored matrix runs (pipelines/form_choice.py) and what the global allocation prices (issue 15).
FACTOR_FORM_CHOICES = ("junction", "fastest")
BUDGETS = ("params", "latency")

# How global rank allocation compares the error of different matrices (pipelines/allocation.py).
ALLOCATION_WEIGHTINGS = ("relative", "absolute", "sqrt_relative", "fisher")


def option(default, help: str, choices=None):
    """A config field with the help text (and choices) of its command-line flag: defined once, here."""
    return field(default=default, metadata={"help": help, "choices": choices})


class JsonRoundTrip:
    def _check_finite(self) -> None:
        """NaN or Inf in a number field is refused by name (it would surface deep in the math otherwise)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{f.name} must be a finite number, got {value}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}; known: {sorted(names)}")
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        return cls(**values)


# allocation=None and statistics=None resolve per method to the measured best (docs/results.md,
# benchmarks/compress_ablation.py): global fisher allocation for every method; one pass of teacher
# statistics for the local methods (as good as the sequential ones at a fraction of the cost),
# sequential statistics for latentllm (its joint fits need them).
DEFAULT_ALLOCATION: dict[str, str] = {}
DEFAULT_STATISTICS: dict[str, str] = {"latentllm": "compressed"}


@dataclass(frozen=True)
class CompressConfig(JsonRoundTrip):
    """Settings of ``retrofitter.compress``.

    ratio: fraction of the compressible linear parameters removed (0 < ratio < 1).
    method: one of ``COMPRESS_METHODS``; the asvd-* variants differ by preconditioner.
    junction: store factors in block-identity form, r(d+d') − r² parameters instead of r(d+d').
    statistics: ``"compressed"`` — layer l is calibrated on the outputs of the already compressed
      layers < l (sequential); ``"teacher"`` — on the original model's activations; ``"teacher_target"``
      — fitted so that the compressed inputs reproduce the original's outputs (error feedback; for
      ``latentllm`` also inside the joint QK / VO and down fits).
      ``None`` (default) resolves per method, ``DEFAULT_STATISTICS``: compressed for ``latentllm``,
      teacher for the local methods.
    damping: λ in C + λ·mean(diag C)·I.
    targets: projection names to compress (adapter names, e.g. ``q k v o gate up down``); empty = all.
    allocation: ``"uniform"`` (each matrix keeps 1 − ratio of its parameters) or ``"global"`` (one
      budget, ranks priced by ``allocation_weighting``); ``None`` (default) picks the method's best
      measured choice, ``DEFAULT_ALLOCATION`` (global for every method today).
    refit_within_layer: collect each projection group's statistics after the groups before it in the
      same layer were replaced (o sees the compressed q/k/v, the MLP the compressed attention) instead
      of one pass of the original layer. ``None`` (default) resolves to the setting of the measured
      figures: on for ``latentllm`` (which needs it) and for global allocation with sequential
      statistics, off for uniform allocation and for teacher statistics.
    """

    ratio: float = option(0.2, "fraction of the linear-layer parameters removed, in (0, 1)")
    method: str = option("asvd-rootcov", "compression method", choices=tuple(COMPRESS_METHODS))
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
                                     choices=("uniform", "global"))
    batch_size: int = option(8, "calibration batch size")
    joint_qk: bool = option(True, "latentllm: joint QK (Tucker) decomposition")
    joint_vo: bool = option(False, "latentllm: joint VO decomposition")
    joint_mlp: bool = option(True, "latentllm: down projection refitted to the compressed MLP intermediate")
    down_fit: str = option("anchored", "latentllm joint MLP: how down is fitted to the compressed intermediate: "
                            "anchored (damping pulls the map towards W_d), ridge (towards zero, the paper's "
                            "regression), select (per layer, anchored or local rootcov, whichever has the "
                            "smaller error on held-out calibration batches)", choices=DOWN_FITS)
    qk_iterations: int = option(8, "latentllm: joint QK alternating eigen-updates")
    vo_iterations: int = option(8, "latentllm: joint VO alternating eigen-updates")
    refit_within_layer: bool | None = option(None, "statistics of each projection group after the groups before "
                                              "it in the layer were replaced (default: on for latentllm and "
                                              "global allocation)")
    mlp_algorithm: str = option("streaming", "latentllm: joint MLP algorithm", choices=("streaming", "auxiliary"))
    mlp_iterations: int = option(4, "latentllm auxiliary MLP: iterations")
    mlp_aux_tokens: int = option(8192, "latentllm auxiliary MLP: token subsample (it holds activations)")
    latent_attention: bool = option(True, "latentllm: latent k/v cache (--no-latent-attention: HF attention over "
                                     "factored projections)")
    allocation_weighting: str = option("fisher", "global allocation: how errors of different matrices compare "
                                        "(fisher: priced by the loss gradient at each matrix's output)",
                                        choices=ALLOCATION_WEIGHTINGS)
    allocation_min_keep: float = option(0.0, "global allocation: each matrix keeps at least this fraction")
    allocation_gradient_blocks: int = option(8, "fisher weighting: calibration blocks of the backward passes")
    kv_ratio: float | None = option(None, "global allocation: the latent k/v widths cache at most this fraction of "
                                     "the original's k/v numbers per token (second budget, solved with the first)")
    factor_forms: str = option("junction", "how each factored matrix runs: junction (the --junction/--no-junction "
                                "form, for every matrix) or fastest (the fastest allowed form by a cost model timed "
                                "on this machine, eval/form_cost.py)", choices=FACTOR_FORM_CHOICES)
    budget: str = option("params", "global allocation priced in stored parameters (params) or in modelled "
                          "prefill time (latency: the time of the uniform plan at --ratio; matrices that run "
                          "faster dense stay dense)", choices=BUDGETS)
    latency_tokens: int = option(512, "tokens of the prefill whose time the cost model predicts (--budget latency, "
                                  "--factor-forms fastest)")

    def __post_init__(self):
        self._check_finite()
        if not 0.0 < self.ratio < 1.0:
            raise ValueError(f"ratio must lie in (0, 1) (fraction of linear parameters removed), got {self.ratio}")
        if self.method not in COMPRESS_METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose from {', '.join(COMPRESS_METHODS)}")
        if self.statistics is None:  # frozen dataclass: resolve the method's default once, at construction
            object.__setattr__(self, "statistics", DEFAULT_STATISTICS.get(self.method, "teacher"))
        if self.statistics not in STATISTICS:
            raise ValueError(f"statistics must be one of {', '.join(STATISTICS)}, got {self.statistics!r}")
        if self.allocation is None:  # frozen dataclass: resolve the method's default once, at construction
            object.__setattr__(self, "allocation", DEFAULT_ALLOCATION.get(self.method, "global"))
        if self.allocation not in ("uniform", "global"):
            raise ValueError(f"allocation must be 'uniform' or 'global', got {self.allocation!r}")
        if self.refit_within_layer is None:
            object.__setattr__(self, "refit_within_layer", self.method == "latentllm" or
                               (self.allocation == "global" and self.statistics != "teacher"))
        if self.method == "latentllm" and not self.refit_within_layer:
            raise ValueError("latentllm fits each projection group on the outputs of the groups before it: "
                             "refit_within_layer must be on")
        if self.allocation_weighting not in ALLOCATION_WEIGHTINGS:
            raise ValueError(f"unknown allocation weighting {self.allocation_weighting!r}; "
                             f"choose from {', '.join(ALLOCATION_WEIGHTINGS)}")
        if self.allocation_gradient_blocks < 1:
            raise ValueError(f"allocation_gradient_blocks must be >= 1, got {self.allocation_gradient_blocks}")
        if self.down_fit not in DOWN_FITS:
            raise ValueError(f"down_fit must be one of {', '.join(DOWN_FITS)}, got {self.down_fit!r}")
        if self.mlp_algorithm not in ("streaming", "auxiliary"):
            raise ValueError(f"mlp_algorithm must be 'streaming' or 'auxiliary', got {self.mlp_algorithm!r}")
        if self.method == "latentllm" and self.mlp_algorithm == "auxiliary" and self.statistics == "teacher_target":
            raise ValueError("mlp_algorithm='auxiliary' fits the compressed model's own MLP inputs; "
                             "statistics='teacher_target' needs the default --mlp-algorithm streaming")
        if not 0.0 <= self.allocation_min_keep < 1.0 - self.ratio + 1e-12:
            raise ValueError(f"allocation_min_keep must lie in [0, 1 - ratio], got {self.allocation_min_keep}")
        if self.kv_ratio is not None:
            if not 0.0 < self.kv_ratio <= 1.0:
                raise ValueError(f"kv_ratio must lie in (0, 1], got {self.kv_ratio}")
            if self.method != "latentllm":
                raise ValueError("kv_ratio (--kv-ratio) bounds the latent k/v cache of --method latentllm; the other "
                                 "methods keep HF's full k/v cache")
            if self.allocation != "global":
                raise ValueError("kv_ratio (--kv-ratio) is a budget of the global allocation: use --allocation global "
                                 "(the default)")
        self._check_forms_and_budget()
        if self.damping < 0:
            raise ValueError(f"damping must be >= 0, got {self.damping}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    def _check_forms_and_budget(self) -> None:
        if self.factor_forms not in FACTOR_FORM_CHOICES:
            raise ValueError(f"factor_forms must be one of {', '.join(FACTOR_FORM_CHOICES)}, got {self.factor_forms!r}")
        if self.budget not in BUDGETS:
            raise ValueError(f"budget must be one of {', '.join(BUDGETS)}, got {self.budget!r}")
        if self.latency_tokens < 1:
            raise ValueError(f"latency_tokens must be >= 1, got {self.latency_tokens}")
        if (self.factor_forms != "junction" or self.budget != "params") and self.method == "latentllm":
            raise ValueError("--factor-forms fastest and --budget latency serve the local methods (svd, asvd-*, "
                             "svd-llm); latentllm's latent attention needs its factored projections")
        if self.budget == "latency" and self.allocation != "global":
            raise ValueError("--budget latency prices the global allocation's rank steps: use --allocation global")

    @property
    def preconditioner(self) -> str:
        return COMPRESS_METHODS[self.method]


@dataclass(frozen=True)
class LinearizeConfig(JsonRoundTrip):
    """Settings of ``retrofitter.linearize`` (LoLCATs, design.md §4).

    Hybrid layer: ``feature_map`` (hedgehog, t2r, elu), ``feature_dim`` (projection width; hedgehog
      gives 2x features), ``window`` (sliding width or terraced tile), ``window_kind`` (sliding,
      terraced), ``linear_weight`` (``one``, ``one_minus_gamma`` or ``zero``), ``mix_init`` (theta, gamma = sigmoid);
      ``sinks`` and ``sparse_cache``: what the exact part keeps beyond the window (ops/hybrid_common.py).
    Stage 1 (attention transfer): ``transfer_tokens`` training tokens in blocks of ``seq_len``,
      ``transfer_lr``, ``transfer_epochs``; ``transfer_mode`` ``joint`` (teacher forward of the whole
      model per batch) or ``blockwise`` (teacher inputs of each layer cached to disk once, layers
      trained one by one, resumable).
    Stage 2 (LoRA, the healing stage of pipelines/heal.py): ``lora_tokens``, ``lora_lr``, ``lora_rank``,
      ``lora_alpha``; ``lora_loss`` ``kl`` (default: distillation from the original model, which keeps
      the stage from adapting the model to the training text) or ``next_token`` (the LoLCATs paper's);
      merged into the weights afterwards. 0 tokens skips a stage.
      ``gradient_checkpointing`` (default on): each decoder layer is recomputed in the backward pass,
      so activation memory is one layer's instead of all layers' (the hybrid layer keeps about 350 MB
      of intermediates per 2048 tokens for backward; 30 layers would need ~10 GB) for ~30 % more time.
    ``keep_softmax_layers``: layer indices left as softmax attention; ``keep_softmax_top`` K: after stage 1,
      K hybrid layers get their softmax attention back (needs stage 1), ranked by ``keep_softmax_by``:
      ``mse`` the largest attention-transfer MSE (measured on the probe blocks), ``recall`` the largest
      gain in retrieval-probe answer likelihood (``pipelines.recall_layers``).
    """

    feature_map: str = option("hedgehog", "feature map of the linear attention (modules/feature_maps.py)")
    feature_dim: int = option(64, "feature-map projection width (hedgehog gives 2x features)")
    window: int = option(64, "softmax window: sliding width or terraced tile")
    window_kind: str = option("terraced", "softmax window kind (ops/hybrid_common.py WINDOW_KINDS)")
    linear_weight: str = option("one", "weight of the linear terms: one, one_minus_gamma or zero (no linear part)")
    sinks: int = option(0, "attention sinks: the first S tokens are always attended exactly (0: none)")
    sparse_cache: int = option(0, "sparse cache (LoLA): per layer and kv head, the M keys the linear state recalls "
                                  "worst are attended exactly (0: none)")
    mix_init: float = option(-2.2, "initial theta of the mixing weight gamma = sigmoid(theta)")
    transfer_tokens: int = option(200_000, "stage 1 (attention transfer) training tokens; 0 skips it")
    lora_tokens: int = option(100_000, "stage 2 (LoRA) training tokens; 0 skips it")
    seq_len: int = option(512, "training block length")
    batch_size: int = option(1, "training batch size")
    transfer_lr: float = option(1e-2, "stage 1 learning rate")
    transfer_epochs: int = option(1, "stage 1 epochs")
    transfer_mode: str = option("joint", "stage 1: joint (teacher forward of the whole model per batch) or "
                                 "blockwise (teacher inputs cached per layer, resumable)",
                                 choices=("joint", "blockwise"))
    lora_lr: float = option(1e-4, "stage 2 learning rate")
    lora_rank: int = option(8, "stage 2 LoRA rank")
    lora_alpha: int = option(16, "stage 2 LoRA alpha")
    lora_dropout: float = option(0.0, "stage 2 LoRA dropout (must be 0: the LoRA factors are merged per tensor)")
    lora_loss: str = option("kl", "stage 2 objective: kl (distillation from the original model) or next_token",
                             choices=LORA_LOSSES)
    grad_clip: float = option(1.0, "gradient-norm clip of both stages (0: none)")
    gradient_checkpointing: bool = option(True, "recompute each decoder layer in the LoRA backward (memory of "
                                           "one layer's activations instead of all, ~30 %% more time)")
    keep_softmax_layers: tuple[int, ...] = option((), "comma-separated layer indices that keep softmax attention")
    keep_softmax_top: int = option(0, "after stage 1, put softmax attention back in K hybrid layers chosen by "
                                    "--keep-softmax-by (0: none)")
    keep_softmax_by: str = option("mse", "how --keep-softmax-top ranks layers: mse (largest attention-transfer error) "
                                  "or recall (largest gain in the answer log-likelihood of retrieval probes hidden in "
                                  "the training text; pipelines/recall_layers.py)", choices=("mse", "recall"))
    seed: int = option(0, "random seed")
    lora_sharding: str = option("ddp", "stage 2 with several processes: ddp or fsdp (FSDP2, student weights sharded)",
                                 choices=SHARDING_MODES)

    def __post_init__(self):
        self._check_finite()
        if self.lora_sharding not in SHARDING_MODES:
            raise ValueError(f"lora_sharding must be one of {', '.join(SHARDING_MODES)}, got {self.lora_sharding!r}")
        # feature_map, window_kind and linear_weight name registries of modules/ and ops/: checked by
        # pipelines.linearize.check_linearize_config (config sits below them and imports neither)
        if self.transfer_mode not in ("joint", "blockwise"):
            raise ValueError(f"unknown transfer_mode {self.transfer_mode!r}; choose one of ['blockwise', 'joint']")
        for name in ("feature_dim", "window", "seq_len", "batch_size", "lora_rank", "transfer_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("transfer_tokens", "lora_tokens", "lora_dropout", "grad_clip", "sinks", "sparse_cache"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (next-token loss), got {self.seq_len}")
        if self.lora_loss not in LORA_LOSSES:
            raise ValueError(f"lora_loss must be one of {', '.join(LORA_LOSSES)}, got {self.lora_loss!r}")
        if self.lora_dropout:
            raise ValueError("lora_dropout is not supported: stage 2 adapts weight tensors (LoRA merged per tensor), "
                             "where input dropout has no place; use 0")
        if self.keep_softmax_top < 0:
            raise ValueError(f"keep_softmax_top must be >= 0, got {self.keep_softmax_top}")
        if self.keep_softmax_top and not self.transfer_tokens:
            raise ValueError("keep_softmax_top ranks layers by their attention-transfer error: it needs stage 1 "
                             "(transfer_tokens > 0)")
        if self.keep_softmax_by not in ("mse", "recall"):
            raise ValueError(f"keep_softmax_by must be mse or recall, got {self.keep_softmax_by!r}")
        if any(int(i) < 0 for i in self.keep_softmax_layers):
            raise ValueError(f"keep_softmax_layers must be layer indices >= 0, got {self.keep_softmax_layers}")

    def hybrid_settings(self) -> dict:
        """Keyword arguments of ``HybridLinearAttention`` for this config."""
        return {"window": self.window, "window_kind": self.window_kind, "feature_map": self.feature_map,
                "feature_dim": self.feature_dim, "mix_init": self.mix_init, "linear_weight": self.linear_weight,
                "sinks": self.sinks, "sparse_cache": self.sparse_cache}

    @classmethod
    def preset(cls, name: str, **overrides) -> "LinearizeConfig":
        """A named budget from ``LINEARIZE_PRESETS`` with ``overrides`` applied on top."""
        if name not in LINEARIZE_PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(LINEARIZE_PRESETS)}")
        return cls(**{**LINEARIZE_PRESETS[name]["config"], **overrides})


# Named budgets: config fields + a description (the CLI adds the data/eval choices it lists).
LINEARIZE_PRESETS: dict[str, dict] = {
    "cpu-small": {
        "description": "SmolLM2-135M on 2 CPU cores in under 30 min (17 min measured): 48k transfer + 24k LoRA tokens of "
                       "wiki-calib in 2048-token blocks (long blocks are what makes 2048-token contexts work), "
                       "blockwise transfer, LoRA lr 1e-3 with activation checkpointing",
        "config": {"transfer_tokens": 49_152, "lora_tokens": 24_576, "seq_len": 2048, "batch_size": 1,
                   "transfer_lr": 1e-2, "lora_lr": 1e-3, "transfer_mode": "blockwise", "transfer_epochs": 2,
                   "lora_loss": "next_token"},  # the measured recipe; --lora-loss kl distils from the original
        "eval_max_tokens": 16_384,
    },
    "quality": {
        "description": "window 128 (a 128-token softmax window), stage 2 distilled from the original (KL), and twice "
                       "cpu-small's tokens: 96k transfer + 48k LoRA tokens at 2048. SmolLM2-135M measured 1.04x the "
                       "original's perplexity at seq 512 and 1.15x at 2048 (cpu-small: 1.14x / 1.28x) for a 19.9 MiB "
                       "state (14.2); 18.6 min of training measured on 2 cores",
        "config": {"transfer_tokens": 98_304, "lora_tokens": 49_152, "seq_len": 2048, "batch_size": 1,
                   "transfer_lr": 1e-2, "lora_lr": 1e-3, "transfer_mode": "blockwise", "transfer_epochs": 2,
                   "lora_loss": "kl", "window": 128},
        "eval_max_tokens": 16_384,
    },
    "swa-sinks": {
        "description": "the training-free baseline: a 64-token sliding window plus 4 attention sinks, no linear part, "
                       "no training (what every trained hybrid must beat)",
        "config": {"transfer_tokens": 0, "lora_tokens": 0, "window": 64, "window_kind": "sliding", "sinks": 4,
                   "linear_weight": "zero"},
        "eval_max_tokens": 16_384,
    },
    "gpu-small": {
        "description": "one GPU, ~10-20 min for a 135M-1B model: 2M + 2M tokens at 2048",
        "config": {"transfer_tokens": 2_000_000, "lora_tokens": 2_000_000, "seq_len": 2048, "batch_size": 4,
                   "transfer_lr": 1e-2, "lora_lr": 2e-4},
        "eval_max_tokens": None,
    },
    "paper": {
        "description": "LoLCATs 7B/8B recipe scale: 20M + 20M tokens at 1024, batch 8 (paper: 40M total)",
        "config": {"transfer_tokens": 20_000_000, "lora_tokens": 20_000_000, "seq_len": 1024, "batch_size": 8,
                   "transfer_lr": 1e-2, "lora_lr": 1e-4},
        "eval_max_tokens": None,
    },
}


@dataclass(frozen=True)
class EvalConfig(JsonRoundTrip):
    """Settings of ``retrofitter.evaluate``."""

    corpora: tuple[str, ...] = ("wiki-eval",)
    seq_len: int = 512
    max_eval_tokens: int | None = None
    batch_size: int = 4
    context_for_macs: int = 512
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.seq_len < 2:
            raise ValueError(f"the evaluation window (seq_len) must be >= 2 tokens, got {self.seq_len}")
        if self.batch_size < 1:
            raise ValueError(f"the evaluation batch size must be >= 1, got {self.batch_size}")
        if self.max_eval_tokens is not None and self.max_eval_tokens < self.seq_len:
            raise ValueError(f"max_eval_tokens ({self.max_eval_tokens}) is below one evaluation window "
                             f"({self.seq_len} tokens): no perplexity could be measured")



@dataclass(frozen=True)
class HealConfig(JsonRoundTrip):
    """Settings of ``retrofitter.heal`` (pipelines/heal.py): LoRA distillation of a converted model.

    The student (the converted model) learns the teacher's (the original's) next-token distribution:
    L = (1 − nll_weight) τ² KL(teacher ‖ student) + nll_weight · NLL, on blocks of ``seq_len`` tokens.
    LoRA (rank ``lora_rank``, scale ``lora_alpha / lora_rank``) adapts ``targets`` (adapter projection
    names; empty = every projection of a compressed model, q/k/v/o of a linearized one) and is merged
    exactly afterwards. Budget: ``tokens`` (all processes together) and/or ``minutes`` of training,
    whichever ends first. AdamW, ``lr`` with ``warmup_steps`` of linear warm-up, then cosine decay to
    ``min_lr_ratio · lr`` over the budget. Resumable: the LoRA factors and the optimizer state are
    written every ``checkpoint_every`` steps.
    """

    tokens: int = option(65_536, "training tokens, all processes together (0: --minutes alone)")
    minutes: float = option(0.0, "training time budget in minutes (0: --tokens alone); the first budget spent stops")
    seq_len: int = option(512, "training block length")
    batch_size: int = option(1, "blocks per step and process")
    lr: float = option(5e-4, "peak AdamW learning rate")
    warmup_steps: int = option(10, "linear warm-up steps")
    min_lr_ratio: float = option(0.1, "the cosine schedule ends at this fraction of --lr")
    lora_rank: int = option(16, "LoRA rank")
    lora_alpha: float = option(32.0, "LoRA alpha (scale alpha / rank)")
    nll_weight: float = option(0.0, "weight of the next-token loss mixed with the KL (0: KL alone, 1: next-token alone)")
    temperature: float = option(1.0, "distillation temperature tau")
    teacher_topk: int = option(0, "cache the teacher's top-k log-probs to the work dir once (0: full teacher "
                                "logits, the teacher runs beside the student)")
    chunk_tokens: int = option(256, "positions per loss chunk (memory of one chunk's logits)")
    targets: tuple[str, ...] = option((), "comma-separated projections to adapt (adapter names q,k,v,o,gate,up,down; "
                                       "default: all of a compressed model, q,k,v,o of a linearized one)")
    gradient_checkpointing: bool = option(True, "recompute each decoder layer in backward (memory linear in the "
                                           "sequence length)")
    grad_clip: float = option(1.0, "gradient-norm clip (0: none)")
    checkpoint_every: int = option(25, "steps between resume checkpoints in the work dir")
    seed: int = option(0, "random seed (LoRA init, data order)")
    sharding: str = option("ddp", "with several processes: ddp (whole student per process, averaged LoRA gradients) "
                            "or fsdp (FSDP2 fully_shard per decoder layer: student weights sharded)",
                            choices=SHARDING_MODES)

    def __post_init__(self):
        self._check_finite()
        if self.sharding not in SHARDING_MODES:
            raise ValueError(f"sharding must be one of {', '.join(SHARDING_MODES)}, got {self.sharding!r}")
        for name in ("tokens", "minutes", "warmup_steps", "nll_weight", "teacher_topk", "grad_clip", "min_lr_ratio"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.tokens == 0 and self.minutes == 0:
            raise ValueError("give a training budget: tokens > 0 (--tokens) or minutes > 0 (--minutes)")
        for name in ("batch_size", "lora_rank", "chunk_tokens", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (next-token distributions), got {self.seq_len}")
        if self.lr <= 0 or self.lora_alpha <= 0 or self.temperature <= 0:
            raise ValueError("lr, lora_alpha and temperature must be > 0")
        if self.nll_weight > 1 or self.min_lr_ratio > 1:
            raise ValueError(f"nll_weight and min_lr_ratio must lie in [0, 1], got {self.nll_weight}, {self.min_lr_ratio}")
