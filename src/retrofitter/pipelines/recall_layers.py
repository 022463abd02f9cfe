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

A cheaper criterion needs no hybrid at all (``keep_softmax_by="retrieval"``, the retrieval heads of
DuoAttention / RazorAttention): with every layer computing the original softmax attention, the share of
layer ``l``'s attention that the answer positions put on the needle sentence,

    score_l = mean_p mean_{heads} mean_{t in answer_p} sum_{j in needle_p} A_l[t - 1, j]

(``A_l`` the layer's attention weights; row ``t - 1`` predicts answer token ``t``). Layers that copy the key
from far back score high; layers that only read their neighbourhood score ~0. One forward per probe, and
it can run before any training (it reads the original attention only).

The same forward measures ``keep_softmax_by="reach"``: the share of the answer rows' attention that falls
outside the hybrid's window and sinks (what a hybrid layer must get from its cache or linear state),

    reach_l = mean_p mean_{heads} mean_{t in answer_p} sum_{j not in W_{t-1} ∪ sinks} A_l[t - 1, j],

high for layers that read broadly over the whole context even when they do not look at the key.
``"retrieval+reach"`` takes layers from both rankings in turn, retrieval first (a layer ranked by both counts
once): the layers that copy the key and the layers whose broad reading the window cannot replace.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..adapters.hybrid_attention import hybrid_attention_modules, restore_softmax
from ..eval.passkey import RetrievalProbe

__all__ = ["answer_logprob", "recall_gains", "retrieval_scores", "take_in_turn", "keep_softmax_for_recall", "RANKINGS"]

RANKINGS = ("recall", "retrieval", "reach", "retrieval+reach")  # keep_softmax_for_recall's criteria (module docstring)


@torch.no_grad()
def answer_logprob(model: nn.Module, probes: list[RetrievalProbe]) -> float:
    """Mean over probes of ``sum_t log p(ids[t] | ids[:t])`` over the answer tokens ``t >= answer_start``."""
    device = next(model.parameters()).device
    total = 0.0
    for probe in probes:
        ids, answer_start = probe.ids.to(device), probe.answer_start
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits[0, answer_start - 1:].float()  # [A, V]
        total += float(-F.cross_entropy(logits, ids[0, answer_start:], reduction="sum"))
    return total / len(probes)


def recall_gains(model: nn.Module, probes: list[RetrievalProbe], progress: bool = True) -> dict:
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


@torch.no_grad()
def retrieval_scores(model: nn.Module, probes: list[RetrievalProbe], progress: bool = True) -> dict:
    """``{"scores": {layer: score_l}, "head_scores": {layer: [per query head]}, "reach": {layer: reach_l}}``
    (module docstring), measured with every hybrid layer in softmax mode (the original model); the modes are
    restored afterwards."""
    modules = hybrid_attention_modules(model)
    if not modules:
        raise ValueError("the model has no hybrid attention layers to rank")
    if not probes:
        raise ValueError("retrieval_scores needs at least one probe")
    device = next(model.parameters()).device
    heads = {layer: torch.zeros(module.n_heads, dtype=torch.float64) for layer, module in modules.items()}
    reach = dict.fromkeys(modules, 0.0)
    for probe in tqdm(probes, desc="retrieval scores", disable=not progress):
        rows = torch.arange(probe.answer_start - 1, probe.ids.shape[1] - 1, device=device)  # predict the answer

        def needle_share_and_reach(module, q, k):  # q [1, h, n, dh], k [1, g, n, dh]
            weights = module.softmax_weights(q[:, :, rows], k, rows)  # [1, h, A, n]
            share = weights[0, :, :, probe.needle_start:probe.needle_end].sum(-1).mean(-1)  # [h]
            heads[module.layer_idx] += share.double().cpu() / len(probes)
            exact = module.hybrid.window_and_sinks(rows[:, None], torch.arange(k.shape[2], device=device)[None, :])
            reach[module.layer_idx] += float(1 - (weights[0] * exact).sum(-1).mean()) / len(probes)

        for module in modules.values():
            module.mode, module.score_hook = "softmax", needle_share_and_reach
        try:
            model(input_ids=probe.ids[:, :-1].to(device), use_cache=False)
        finally:
            for module in modules.values():
                module.mode, module.score_hook = "hybrid", None
    return {"scores": {layer: float(share.mean()) for layer, share in heads.items()},
            "head_scores": {layer: share.tolist() for layer, share in heads.items()}, "reach": reach}


def take_in_turn(rankings: list[dict], count: int) -> list[int]:
    """``count`` layers: each ranking ``{layer: value}`` in turn adds its highest-valued layer not chosen yet."""
    orders = [sorted(values, key=values.get, reverse=True) for values in rankings]
    chosen: list[int] = []
    while len(chosen) < min(count, len(orders[0])):
        for order in orders:
            if len(chosen) < min(count, len(orders[0])):
                chosen.append(next(layer for layer in order if layer not in chosen))
    return chosen


def keep_softmax_for_recall(model: nn.Module, probes: list[RetrievalProbe], count: int, progress: bool = True,
                            by: str = "recall") -> dict:
    """Softmax back in the ``count`` hybrid layers ranked first ``by`` ``"recall"`` (largest recall gain),
    ``"retrieval"`` (largest retrieval score), ``"reach"`` (largest reach) or ``"retrieval+reach"`` (both in
    turn); the ranking and the chosen layers."""
    if by not in RANKINGS:
        raise ValueError(f"unknown ranking {by!r}; choose one of {list(RANKINGS)}")
    modules = hybrid_attention_modules(model)
    if not 1 <= count <= len(modules):
        raise ValueError(f"count must lie in 1..{len(modules)} (the hybrid layers); got {count}")
    ranking = recall_gains(model, probes, progress) if by == "recall" else retrieval_scores(model, probes, progress)
    rankings = ([ranking["scores"], ranking["reach"]] if by == "retrieval+reach"
                else [ranking[{"recall": "gains", "retrieval": "scores", "reach": "reach"}[by]]])
    chosen = take_in_turn(rankings, count)
    return {**ranking, "by": by, "restored_softmax_layers": restore_softmax(model, chosen), "probes": len(probes),
            "probe_tokens": int(probes[0].ids.numel())}
