"""Which hybrid layers get softmax attention back for recall: a measured criterion.

A kept softmax layer remembers everything (its KV cache grows with the context); a few of them can
give a hybrid full recall for a cache that stays small (``k`` of ``L`` layers: ``k / L`` of the
original's KV bytes plus the hybrid states). Which ``k``? The transfer MSE ranks the last layers
first (their outputs are largest) and barely moves perplexity (docs/results.md §5). Here each layer
is ranked by what it does for retrieval: with only layer ``l`` computing exact softmax attention
(``HybridSelfAttention.mode = "softmax"``, same projections), the mean log-likelihood of the answer
of teacher-forced retrieval probes (``eval.passkey.retrieval_probes``: a key hidden in training text)

    gain_l = mean_p log p(answer_p | prompt_p; layer l softmax) - mean_p log p(answer_p | prompt_p; all hybrid)

and the ``k`` layers with the largest gain get their softmax back (``restore_softmax``). One forward
per layer and probe, no training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..adapters.hybrid_attention import hybrid_attention_modules, restore_softmax

__all__ = ["answer_logprob", "recall_gains", "keep_softmax_for_recall"]


@torch.no_grad()
def answer_logprob(model: nn.Module, probes: list[tuple[torch.Tensor, int]]) -> float:
    """Mean over probes of ``sum_t log p(ids[t] | ids[:t])`` over the answer tokens ``t >= answer_start``."""
    device = next(model.parameters()).device
    total = 0.0
    for ids, answer_start in probes:
        ids = ids.to(device)
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits[0, answer_start - 1:].float()  # [A, V]
        total += float(-F.cross_entropy(logits, ids[0, answer_start:], reduction="sum"))
    return total / len(probes)


def recall_gains(model: nn.Module, probes: list[tuple[torch.Tensor, int]], progress: bool = True) -> dict:
    """``{"baseline": log-likelihood with every layer hybrid, "gains": {layer: gain_l}}`` (module docstring)."""
    modules = hybrid_attention_modules(model)
    if not modules:
        raise ValueError("the model has no hybrid attention layers to rank")
    if not probes:
        raise ValueError("recall_gains needs at least one probe")
    baseline = answer_logprob(model, probes)
    gains = {}
    for layer, module in tqdm(modules.items(), desc="recall gain per layer", disable=not progress):
        module.mode = "softmax"
        try:
            gains[layer] = answer_logprob(model, probes) - baseline
        finally:
            module.mode = "hybrid"
    return {"baseline": baseline, "gains": gains}


def keep_softmax_for_recall(model: nn.Module, probes: list[tuple[torch.Tensor, int]], count: int,
                            progress: bool = True) -> dict:
    """Softmax back in the ``count`` hybrid layers with the largest recall gain; the ranking and the chosen layers."""
    modules = hybrid_attention_modules(model)
    if not 1 <= count <= len(modules):
        raise ValueError(f"count must lie in 1..{len(modules)} (the hybrid layers); got {count}")
    ranking = recall_gains(model, probes, progress)
    chosen = sorted(ranking["gains"], key=lambda layer: ranking["gains"][layer], reverse=True)[:count]
    return {**ranking, "restored_softmax_layers": restore_softmax(model, chosen), "probes": len(probes),
            "probe_tokens": int(probes[0][0].numel())}
