"""Stage 2 of LoLCATs: LoRA on the attention projections, trained by the healing stage, then merged.

For every attention projection W ∈ {W_q, W_k, W_v, W_o} of every layer (``modules.low_rank_delta``):

    W' = W + (α / r) · B A,   A ∈ R^{r×d_in} (random), B ∈ R^{d_out×r} (zeros at start)

trained by ``pipelines.heal`` on token blocks [N, seq_len] with ``config.lora_loss``: ``kl`` (default),
KL(teacher ‖ student) of the next-token distributions with the original model as teacher, or
``next_token``, L = −(1/T) Σ_t log p(u_{t+1} | u_{≤t}) (the LoLCATs paper's: it also adapts the model
to the training text, which confounds the comparison with the original). Everything else (including
the feature maps from stage 1) is frozen; merging folds BA into W, so the result has exactly the
original parameter layout. The loop runs under ``accelerate`` (DDP with several processes; gloo on CPU).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..adapters import adapter_for
from ..config import HealConfig, LinearizeConfig
from .heal import ATTENTION_TARGETS, heal_model

__all__ = ["LORA_TARGETS", "ChunkedNextTokenLoss", "lora_target_module_names", "heal_config_for", "lora_finetune"]

LORA_TARGETS = ATTENTION_TARGETS  # adapter names of the projections LoLCATs adapts


def lora_target_module_names(model: nn.Module) -> list[str]:
    """PEFT ``target_modules`` (attribute names, e.g. ``q_proj`` … ``o_proj``) from the model's adapter."""
    adapter = adapter_for(model)
    return sorted({adapter.linear_paths[name].rpartition(".")[2] for name in LORA_TARGETS})


class ChunkedNextTokenLoss(nn.Module):
    """Mean next-token NLL of a causal LM without holding [n, vocab] logits for every position.

        L = (1 / (b (n − 1))) Σ_{chunks c} Σ_{t ∈ c} −log softmax(H_t W_headᵀ)[u_{t+1}]

    with H = the hidden states entering the LM head (``adapter.head_inputs``). Each chunk of
    ``chunk_tokens`` positions computes its logits inside a (non-reentrant) checkpoint, so backward
    recomputes them: the peak is one chunk's logits (256 × 49152 floats ≈ 50 MB for SmolLM2) instead
    of four full [n, vocab] tensors (logits, log-softmax and their gradients: ~1.6 GB at n = 2048).
    Same value as HF's ``labels=`` loss (tested). The wrapped ``model`` is a submodule, so DDP wrapping
    this module sees (and synchronises) its trainable parameters.
    """

    def __init__(self, model: nn.Module, chunk_tokens: int = 256):
        super().__init__()
        self.model = model
        self.chunk_tokens = int(chunk_tokens)

    def _causal_lm(self) -> nn.Module:
        get_base = getattr(self.model, "get_base_model", None)  # a PEFT wrapper
        return get_base() if get_base is not None else self.model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        lm = self._causal_lm()
        adapter = adapter_for(lm)
        hidden = adapter.head_inputs(lm, input_ids)[:, :-1]
        targets = input_ids[:, 1:]

        def chunk_nll(states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            logits = adapter.head_logits(lm, states)  # the LM head, soft-capped where the family caps logits
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")

        total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
        for start in range(0, targets.shape[1], self.chunk_tokens):
            stop = start + self.chunk_tokens
            total = total + checkpoint(chunk_nll, hidden[:, start:stop], targets[:, start:stop], use_reentrant=False)
        return total / targets.numel()


def heal_config_for(config: LinearizeConfig, blocks: torch.Tensor) -> HealConfig:
    """The healing-stage settings of LoLCATs stage 2: one pass over ``blocks`` [N, seq_len] at ``lora_lr``
    (a short warm-up, then cosine), LoRA on q/k/v/o, KL or next-token loss as ``config.lora_loss`` says."""
    steps = -(-blocks.shape[0] // config.batch_size)
    return HealConfig(tokens=int(blocks.numel()), seq_len=int(blocks.shape[1]), batch_size=config.batch_size,
                      lr=config.lora_lr, warmup_steps=min(10, steps // 10), lora_rank=config.lora_rank,
                      lora_alpha=float(config.lora_alpha), nll_weight=1.0 if config.lora_loss == "next_token" else 0.0,
                      targets=LORA_TARGETS, gradient_checkpointing=config.gradient_checkpointing,
                      grad_clip=config.grad_clip, seed=config.seed,
                      sharding=config.lora_sharding)


def lora_finetune(model: nn.Module, blocks: torch.Tensor, config: LinearizeConfig, accelerator=None,
                  progress: bool = True, teacher: nn.Module | None = None) -> tuple[nn.Module, dict]:
    """Train LoRA adapters on ``blocks`` [N, seq_len] and merge them; returns ``(merged_model, report)``.

    ``teacher``: the original model of the KL loss; None with ``lora_loss="kl"`` distils from a frozen copy
    of ``model`` itself (the control: the original given the same stage). Each process reads its share of
    the blocks; the merged weights are identical on every process because DDP averages the LoRA gradients.
    """
    if blocks.ndim != 2 or blocks.shape[1] < 2:
        raise ValueError(f"LoRA blocks must be [N, seq_len >= 2]; got {tuple(blocks.shape)}")
    targets = lora_target_module_names(model)
    if config.lora_loss == "kl" and teacher is None:
        teacher = copy.deepcopy(model)
    merged, report = heal_model(model, teacher if config.lora_loss == "kl" else None, blocks,
                                heal_config_for(config, blocks), accelerator=accelerator, progress=progress,
                                description=f"LoRA ({config.lora_loss})")
    report["tokens_per_process"] = report["tokens"] // report["processes"]
    report["targets"] = targets
    return merged, report
