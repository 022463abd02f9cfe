"""Stage 2 of LoLCATs: LoRA on the attention projections with next-token loss, then merge.

For every attention projection W ∈ {W_q, W_k, W_v, W_o} of every layer (PEFT):

    W' = W + (α / r) · B A,   A ∈ R^{r×d_in} (random), B ∈ R^{d_out×r} (zeros at start)

trained on  L = −(1/T) Σ_t log p(u_{t+1} | u_{≤t})  over token blocks [N, seq_len]; everything else
(including the feature maps from stage 1) is frozen. ``merge_and_unload`` folds BA into W, so the
result has exactly the original parameter layout. The loop runs under ``accelerate``
(``accelerator.prepare`` wraps the model in DDP when several processes run; gloo on CPU).
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..adapters import adapter_for
from ..config import LinearizeConfig
from .training import make_accelerator

__all__ = ["LORA_TARGETS", "ChunkedNextTokenLoss", "lora_target_module_names", "lora_finetune"]

LORA_TARGETS = ("q", "k", "v", "o")  # adapter names of the projections LoLCATs adapts


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


def lora_finetune(model: nn.Module, blocks: torch.Tensor, config: LinearizeConfig, accelerator=None,
                  progress: bool = True) -> tuple[nn.Module, dict]:
    """Train LoRA adapters on ``blocks`` [N, seq_len] and merge them; returns ``(merged_model, report)``.

    Each process sees its shard of the blocks (``accelerator.prepare`` of the data loader); the
    merged weights are identical on every process because DDP averages the LoRA gradients.
    """
    from peft import LoraConfig, get_peft_model

    if blocks.ndim != 2 or blocks.shape[1] < 2:
        raise ValueError(f"LoRA blocks must be [N, seq_len >= 2]; got {tuple(blocks.shape)}")
    accelerator = accelerator or make_accelerator(next(model.parameters()).device)
    for p in model.parameters():
        p.requires_grad_(False)
    lora_config = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                             target_modules=lora_target_module_names(model), bias="none")
    # PEFT seeds A from the global generator: seed it so every process starts from the same adapters.
    torch.manual_seed(config.seed)
    with warnings.catch_warnings():
        # PEFT probes transformers' deprecated `is_gradient_checkpointing`; the warning is theirs, not the user's.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = get_peft_model(model, lora_config)
    if config.gradient_checkpointing:
        # Non-reentrant checkpointing: recomputes each decoder layer in backward; needs no input grads.
        peft_model.base_model.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)
    optimizer = torch.optim.AdamW(trainable, lr=config.lora_lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(config.seed)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(blocks), batch_size=config.batch_size,
                                         shuffle=True, generator=generator)
    objective, optimizer, loader = accelerator.prepare(ChunkedNextTokenLoss(peft_model), optimizer, loader)
    objective.train()
    losses = []
    start = time.perf_counter()
    for (ids,) in tqdm(loader, desc="LoRA", disable=not progress, leave=False):
        loss = objective(ids)
        accelerator.backward(loss)
        if config.grad_clip:
            accelerator.clip_grad_norm_(trainable, config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - start
    merged = accelerator.unwrap_model(objective).model.merge_and_unload()
    if config.gradient_checkpointing:
        merged.activation_checkpointing_disable()
    merged.eval()
    for p in merged.parameters():
        p.requires_grad_(False)
    window = max(1, len(losses) // 4)
    report = {
        "seconds": seconds,
        "steps": len(losses),
        "tokens_per_process": int(len(losses) * config.batch_size * blocks.shape[1]),
        "processes": accelerator.num_processes,
        "trainable_parameters": n_trainable,
        "targets": lora_config.target_modules if isinstance(lora_config.target_modules, list)
        else sorted(lora_config.target_modules),
        "loss_first": sum(losses[:window]) / window if losses else None,
        "loss_last": sum(losses[-window:]) / window if losses else None,
        "loss_history": losses,
    }
    return merged, report
