"""Perplexity over non-overlapping windows (design.md §5).

For token blocks ``T [n_blocks, L]`` (each block already starts with BOS when the tokenizer has one),
the model predicts tokens 1..L-1 of every block from their prefixes:

    ppl = exp( Σ_blocks Σ_{t=1}^{L-1} −log p(T[b, t] | T[b, :t]) / (n_blocks · (L − 1)) )

Two models on the same blocks compare by their perplexity ratio, with a paired interval over blocks
(``paired_ratio``): d_b = (nll_model[b] − nll_base[b]) / (L − 1), log ratio = mean_b d_b.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..adapters import UnsupportedArchitectureError, adapter_for

__all__ = ["PerplexityResult", "PairedRatio", "perplexity", "perplexity_from_nlls", "block_nlls", "paired_ratio",
           "block_nll", "block_nll_reference"]


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    nll_sum: float
    tokens: int
    blocks: int
    seq_len: int


def block_nll_reference(model: nn.Module, blocks: torch.Tensor) -> torch.Tensor:
    """``block_nll`` from the model's full logits [b, L, vocab] (any causal LM; the slow reference)."""
    logits = model(input_ids=blocks, use_cache=False).logits  # [b, L, vocab]
    # Per-token losses in float32 (bf16 logits upcast); sums in float64. A float64 copy of the
    # [b, L, vocab] logits would cost more time and memory than the model itself on small models.
    logits = logits[:, :-1].float()
    targets = blocks[:, 1:]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return nll.view(targets.shape).double().sum(dim=1)


def block_nll(model: nn.Module, blocks: torch.Tensor, chunk_tokens: int = 256) -> torch.Tensor:
    """Summed next-token negative log-likelihood per block, float64 [n_blocks].

    For supported architectures the LM head runs on ``chunk_tokens`` positions at a time,
    Σ_c Σ_{t∈c} −log softmax(H_t W_headᵀ)[u_{t+1}] with H = ``adapter.head_inputs``, so at most
    [b, chunk_tokens, vocab] logits exist (the full [4, 2048, 49152] logits of SmolLM2 plus their
    float32 log-softmax are ~3 GB, more than the model). Models of any other architecture use
    ``block_nll_reference`` (the same figure from their full logits).
    """
    try:
        adapter = adapter_for(model)
    except UnsupportedArchitectureError:
        return block_nll_reference(model, blocks)
    hidden = adapter.head_inputs(model, blocks)[:, :-1]  # [b, L-1, d]
    targets = blocks[:, 1:]
    total = torch.zeros(blocks.shape[0], dtype=torch.float64, device=hidden.device)
    for start in range(0, targets.shape[1], chunk_tokens):
        logits = adapter.head_logits(model, hidden[:, start:start + chunk_tokens]).float()  # soft-capped if any
        chunk_targets = targets[:, start:start + chunk_tokens]
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk_targets.reshape(-1), reduction="none")
        total += nll.view(chunk_targets.shape).double().sum(dim=1)
    return total


@torch.no_grad()
def block_nlls(model: nn.Module, blocks: torch.Tensor, batch_size: int = 4, progress: bool = True,
               description: str = "perplexity") -> torch.Tensor:
    """Summed next-token NLL of every block of ``blocks`` [n_blocks, seq_len], float64 [n_blocks] on the CPU."""
    if blocks.ndim != 2 or blocks.shape[1] < 2:
        raise ValueError(f"blocks must be [n_blocks, seq_len >= 2], got {tuple(blocks.shape)}")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    sums = []
    starts = range(0, blocks.shape[0], batch_size)
    for start in tqdm(starts, desc=description, disable=not progress, leave=False):
        batch = blocks[start:start + batch_size].to(device)
        nll = block_nll(model, batch)
        if not torch.isfinite(nll).all():
            raise FloatingPointError(f"non-finite loss in blocks {start}..{start + len(batch) - 1}")
        sums.append(nll.cpu())
    model.train(was_training)
    return torch.cat(sums)


def perplexity_from_nlls(nlls: torch.Tensor, seq_len: int) -> PerplexityResult:
    """The module docstring's perplexity from the per-block NLL sums [n_blocks] of ``block_nlls``."""
    total = float(nlls.sum())
    tokens = nlls.shape[0] * (seq_len - 1)
    return PerplexityResult(ppl=math.exp(total / tokens), nll_sum=total, tokens=tokens,
                            blocks=nlls.shape[0], seq_len=seq_len)


def perplexity(model: nn.Module, blocks: torch.Tensor, batch_size: int = 4, progress: bool = True,
               description: str = "perplexity") -> PerplexityResult:
    """Perplexity of ``model`` on token ``blocks`` [n_blocks, seq_len] (see module docstring)."""
    return perplexity_from_nlls(block_nlls(model, blocks, batch_size, progress, description), blocks.shape[1])


@dataclass(frozen=True)
class PairedRatio:
    """ppl_model / ppl_base on the same blocks, with a normal-approximation interval over blocks."""
    ratio: float
    low: float
    high: float
    log_ratio_se: float
    blocks: int


def paired_ratio(nll_base: torch.Tensor, nll_model: torch.Tensor, seq_len: int, z: float = 1.959964) -> PairedRatio:
    """Perplexity ratio of two models from their per-block NLL sums [n_blocks] on the same blocks.

    d_b = (nll_model[b] − nll_base[b]) / (L − 1);  log ratio = mean_b d_b (exactly log(ppl_model / ppl_base));
    se = std_b(d) / √n (sample std, n − 1);  interval = exp(log ratio ± z·se), z = 1.96 for 95 %.
    Blocks are the sampling units: the interval says how much the ratio would move on other text like
    this one. Adjacent blocks of one document are correlated, so it is a lower bound on that spread.
    """
    if nll_base.shape != nll_model.shape or nll_base.ndim != 1:
        raise ValueError(f"per-block NLLs must be two [n_blocks] tensors of one shape, got "
                         f"{tuple(nll_base.shape)} and {tuple(nll_model.shape)}")
    if nll_base.shape[0] < 2:
        raise ValueError(f"a paired interval needs at least 2 blocks, got {nll_base.shape[0]}")
    per_token = (nll_model.double() - nll_base.double()) / (seq_len - 1)  # [n_blocks]
    log_ratio = float(per_token.mean())
    se = float(per_token.std(unbiased=True)) / math.sqrt(per_token.shape[0])
    return PairedRatio(ratio=math.exp(log_ratio), low=math.exp(log_ratio - z * se),
                       high=math.exp(log_ratio + z * se), log_ratio_se=se, blocks=per_token.shape[0])
