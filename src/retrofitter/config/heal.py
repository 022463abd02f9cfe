"""``HealConfig``: LoRA distillation of a converted model from its original (pipelines/heal.py)."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import AUTOCAST_CHOICES, SHARDING_MODES, JsonRoundTrip, option

__all__ = ["HealConfig"]


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
    written every ``checkpoint_every`` steps. The steps' forward runs under ``autocast`` (pipelines/training.py).
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
    autocast: str = option("float32", "autocast dtype of the training steps (LoRA factors, AdamW and the loss stay "
                           "float32): float32 (none), bfloat16, or auto (bfloat16 where it is native: AVX512-BF16, "
                           "AMX, a CUDA device that has it; else float32)", choices=AUTOCAST_CHOICES)
    sharding: str = option("ddp", "with several processes: ddp (whole student per process, averaged LoRA gradients) "
                            "or fsdp (FSDP2 fully_shard per decoder layer: student weights sharded)",
                            choices=SHARDING_MODES)

    def __post_init__(self):
        self._check_finite()
        if self.autocast not in AUTOCAST_CHOICES:
            raise ValueError(f"autocast must be one of {', '.join(AUTOCAST_CHOICES)}, got {self.autocast!r}")
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
