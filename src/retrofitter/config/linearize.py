"""``LinearizeConfig`` (LoLCATs, design.md §4) and its named presets."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import SHARDING_MODES, JsonRoundTrip, option

__all__ = ["LinearizeConfig", "LINEARIZE_PRESETS", "LORA_LOSSES", "KEEP_SOFTMAX_RANKINGS"]

# LoLCATs stage 2 objective: KL to the original model's next-token distribution (pipelines/heal.py), or next-token NLL.
LORA_LOSSES = ("kl", "next_token")
# how keep_softmax_top ranks layers: mse (stage 1's error) or a pipelines.recall_layers criterion
KEEP_SOFTMAX_RANKINGS = ("mse", "recall", "retrieval", "reach", "retrieval+reach")


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
    ``keep_softmax_layers``: layer indices left as softmax attention; ``keep_softmax_top`` K: K hybrid layers get
      their softmax attention back, ranked by ``keep_softmax_by``: ``mse`` the largest attention-transfer MSE
      (measured on the probe blocks; needs stage 1), ``recall`` the largest gain in retrieval-probe answer
      likelihood (after stage 1 when it runs), ``retrieval`` the largest share of the original attention that a
      probe's answer puts on its needle, ``reach`` the largest share of it outside the window and sinks,
      ``retrieval+reach`` both in turn (these three before stage 1, which then skips the kept layers); all but
      ``mse`` in ``pipelines.recall_layers``, on probes of ``probe_tokens`` tokens hidden in the training text.
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
                                  "the training text) or retrieval (largest share of the original attention from a "
                                  "probe's answer onto its needle), reach (largest share of it outside the window and "
                                  "sinks) or retrieval+reach (both in turn; pipelines/recall_layers.py)",
                                  choices=KEEP_SOFTMAX_RANKINGS)
    probe_tokens: int = option(0, "length of the retrieval probes of --keep-softmax-by other than mse (0: --seq-len)")
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
        if self.keep_softmax_by not in KEEP_SOFTMAX_RANKINGS:
            raise ValueError(f"keep_softmax_by must be one of {', '.join(KEEP_SOFTMAX_RANKINGS)}, "
                             f"got {self.keep_softmax_by!r}")
        if self.keep_softmax_top and self.keep_softmax_by == "mse" and not self.transfer_tokens:
            raise ValueError("keep_softmax_by mse ranks layers by their attention-transfer error: it needs stage 1 "
                             "(transfer_tokens > 0); the probe rankings (recall, retrieval, reach, retrieval+reach) need none")
        if self.probe_tokens and self.probe_tokens < 64:
            raise ValueError(f"probe_tokens must be 0 (--seq-len) or >= 64, got {self.probe_tokens}")
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
        "description": "SmolLM2-135M on 2 CPU cores in under 30 min (15 min measured): 48k transfer + 24k LoRA tokens of "
                       "wiki-calib in 2048-token blocks (long blocks are what makes 2048-token contexts work), "
                       "blockwise transfer, LoRA lr 1e-3 with activation checkpointing, 4 attention sinks and a "
                       "64-key sparse cache per layer and kv head in place while training. SmolLM2-135M measured "
                       "0.96x / 1.03x the original's wiki-eval perplexity at seq 512 / 2048 (austen 0.995x / 1.08x; "
                       "swa-sinks 1.12x / 1.19x) for a 25.9 MiB state (docs/results.md 15e)",
        "config": {"transfer_tokens": 49_152, "lora_tokens": 24_576, "seq_len": 2048, "batch_size": 1,
                   "transfer_lr": 1e-2, "lora_lr": 1e-3, "transfer_mode": "blockwise", "transfer_epochs": 2,
                   "lora_loss": "next_token",  # the measured recipe; --lora-loss kl distils from the original
                   "sinks": 4, "sparse_cache": 64},
        "eval_max_tokens": 16_384,
    },
    "quality": {
        "description": "window 128 (a 128-token softmax window), stage 2 distilled from the original (KL), twice "
                       "cpu-small's tokens (96k transfer + 48k LoRA tokens at 2048) and cpu-small's 4 sinks and 64-key "
                       "sparse cache in place while training. SmolLM2-135M measured 0.99x / 1.03x the original's "
                       "wiki-eval perplexity at seq 512 / 2048 (austen 1.01x / 1.06x) for a 31.5 MiB state; 28 min of "
                       "training measured on 2 cores (docs/results.md 15e)",
        "config": {"transfer_tokens": 98_304, "lora_tokens": 49_152, "seq_len": 2048, "batch_size": 1,
                   "transfer_lr": 1e-2, "lora_lr": 1e-3, "transfer_mode": "blockwise", "transfer_epochs": 2,
                   "lora_loss": "kl", "window": 128, "sinks": 4, "sparse_cache": 64},
        "eval_max_tokens": 16_384,
    },
    "swa-sinks": {
        "description": "the training-free baseline: a 64-token sliding window plus 4 attention sinks, no linear part, "
                       "no training (what every trained hybrid must beat)",
        "config": {"transfer_tokens": 0, "lora_tokens": 0, "window": 64, "window_kind": "sliding", "sinks": 4,
                   "linear_weight": "zero"},
        "eval_max_tokens": 16_384,
    },
    "swa-sinks-cache": {
        "description": "training-free recall: swa-sinks plus a LoLA sparse cache of 256 keys per layer and kv head, "
                       "ranked by the recall error of an untrained (identity-initialised) hedgehog linear state; the "
                       "linear state only ranks keys, the output is a softmax over window + sinks + cache",
        "config": {"transfer_tokens": 0, "lora_tokens": 0, "window": 64, "window_kind": "sliding", "sinks": 4,
                   "sparse_cache": 256, "linear_weight": "zero"},
        "eval_max_tokens": 16_384,
    },
    "swa-sinks-recall": {
        "description": "swa-sinks-cache plus softmax attention back in 5 layers, taken in turn from two rankings of "
                       "the original attention on pass keys hidden in 4096-token probes of the training text: the "
                       "share on the key (retrieval) and the share outside the window and sinks (reach); no "
                       "training. Those layers cache every key and value. SmolLM2-135M: passkey 100 %% at 4096 and "
                       "95 %% at 8192 (21 trials each; the original 67 %%), 1.008x / 1.070x perplexity, 0.22x the "
                       "cache at 8192 (docs/results.md 15c)",
        "config": {"transfer_tokens": 0, "lora_tokens": 0, "window": 64, "window_kind": "sliding", "sinks": 4,
                   "sparse_cache": 256, "linear_weight": "zero", "keep_softmax_top": 5, "keep_softmax_by": "retrieval+reach",
                   "probe_tokens": 4096},
        "eval_max_tokens": 16_384,
    },
    "gpu-small": {
        "description": "one GPU, ~10-20 min for a 135M-1B model: 2M + 2M tokens at 2048, with the CPU presets' 4 sinks "
                       "and 64-key sparse cache in training (not measured at this scale)",
        "config": {"transfer_tokens": 2_000_000, "lora_tokens": 2_000_000, "seq_len": 2048, "batch_size": 4,
                   "transfer_lr": 1e-2, "lora_lr": 2e-4, "sinks": 4, "sparse_cache": 64},
        "eval_max_tokens": None,
    },
    "paper": {
        "description": "LoLCATs 7B/8B recipe scale: 20M + 20M tokens at 1024, batch 8 (paper: 40M total), with the CPU "
                       "presets' 4 sinks and 64-key sparse cache in training (not measured at this scale)",
        "config": {"transfer_tokens": 20_000_000, "lora_tokens": 20_000_000, "seq_len": 1024, "batch_size": 8,
                   "transfer_lr": 1e-2, "lora_lr": 1e-4, "sinks": 4, "sparse_cache": 64},
        "eval_max_tokens": None,
    },
}


