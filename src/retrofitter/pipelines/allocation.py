"""Global rank allocation under one parameter budget (``CompressConfig.allocation="global"``).

For every target matrix m (W_m [d'_m, d_m], input second moment C_m from one teacher pass over the
calibration stream — all layers in one sweep, moments discarded after each layer) the weighted
spectrum σ_{m,1} ≥ σ_{m,2} ≥ ... of W_m C_m^{1/2} gives the rootcov error of rank r exactly:
E‖(W_m − Ŵ_m) x‖² = Σ_{i>r} σ_{m,i}². With a junction a rank step r → r+1 costs d_m + d'_m − (2r + 1)
parameters. Greedy water-filling:

    start every matrix at its minimum rank; repeatedly take the step with the largest
    gain/cost = w_m(σ²_{m,r+1}) / cost_m(r) that still fits in the budget (1 − ratio)·Σ_m d_m d'_m

until no step fits, so the plan uses the budget up to less than one rank step of one matrix.
The gain weighting w (``WEIGHTINGS``) decides how errors of different matrices are compared:
``relative`` σ²/Σσ² (each matrix's relative output error counts the same), ``absolute`` σ²/E‖x_0‖²
(output error energy, normalised by the model's input energy only), ``sqrt_relative`` (relative error
gains flattened by a square root: a compromise that spreads ranks more evenly).
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..config import CompressConfig
from ..linalg.moments import damped
from ..linalg.preconditioners import symmetric_power
from ..linalg.ranks import factor_param_count, max_useful_rank, rank_for_keep_fraction
from .calibration import LayerStream, collect_input_moments

__all__ = ["RankItem", "WEIGHTINGS", "allocate_ranks", "weighted_spectra", "global_plan"]

log = logging.getLogger(__name__)


@dataclass
class RankItem:
    """One matrix: input/output dims and σ² of W C^{1/2} (float64, descending)."""

    d_in: int
    d_out: int
    energies: torch.Tensor


def _relative(energies: torch.Tensor, _scale: float) -> torch.Tensor:
    return energies / energies.sum().clamp_min(torch.finfo(energies.dtype).tiny)


def _absolute(energies: torch.Tensor, scale: float) -> torch.Tensor:
    return energies / scale


def _sqrt_relative(energies: torch.Tensor, _scale: float) -> torch.Tensor:
    return _relative(energies, _scale).sqrt()


WEIGHTINGS: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "relative": _relative,
    "absolute": _absolute,
    "sqrt_relative": _sqrt_relative,
}


def _step_cost(item: RankItem, rank: int, junction: bool) -> int:
    """Parameters added by rank → rank + 1."""
    return factor_param_count(item.d_in, item.d_out, rank + 1, junction) - factor_param_count(
        item.d_in, item.d_out, rank, junction)


def allocate_ranks(items: dict, budget: float, junction: bool = True, weighting: str = "relative",
                   min_ranks: dict | None = None, scale: float = 1.0) -> dict:
    """Greedy water-filling (module docstring): key -> rank with Σ params ≤ budget.

    ``min_ranks`` (key -> rank, default 1) are granted first; ``ValueError`` if they alone exceed the budget.
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"unknown allocation weighting {weighting!r}; choose from {sorted(WEIGHTINGS)}")
    ranks = {key: max(1, (min_ranks or {}).get(key, 1)) for key in items}
    used = sum(factor_param_count(item.d_in, item.d_out, ranks[key], junction) for key, item in items.items())
    if used > budget:
        raise ValueError(f"the minimum ranks alone need {used} parameters, more than the budget {budget:.0f}")
    gains = {key: WEIGHTINGS[weighting](item.energies.to(torch.float64), scale).tolist() for key, item in items.items()}
    limits = {key: min(max_useful_rank(item.d_in, item.d_out, junction), len(gains[key])) for key, item in items.items()}
    heap: list = []

    def push(key):
        rank = ranks[key]
        if rank < limits[key]:
            cost = _step_cost(items[key], rank, junction)
            heapq.heappush(heap, (-gains[key][rank] / cost, cost, str(key), key))

    for key in items:
        push(key)
    while heap:
        _, cost, _, key = heapq.heappop(heap)
        if used + cost > budget:
            continue  # this matrix cannot grow any more within the budget
        ranks[key] += 1
        used += cost
        push(key)
    return ranks


def weighted_spectra(weight: torch.Tensor, moment: torch.Tensor, damping: float) -> torch.Tensor:
    """σ² of W (damped C)^{1/2}, descending [min(d', d)] (float64)."""
    root, _ = symmetric_power(damped(moment.to(torch.float64), damping), 0.5)
    return torch.linalg.svdvals(weight.detach().to(root) @ root).pow(2)


@torch.no_grad()
def global_plan(model: nn.Module, adapter, config: CompressConfig, stream: LayerStream,
                targets: list[str]) -> tuple[dict, dict]:
    """One teacher pass over all layers → weighted spectra → greedy plan. Returns (plan, report)."""
    layers = adapter.decoder_layers(model)
    leader_of = {name: group[0] for group in adapter.linear_groups for name in group}
    items: dict = {}
    dense_total = 0
    scale = None
    for index, layer in enumerate(layers):
        leaders = {leader_of[n]: adapter.get_linear(layer, leader_of[n]) for n in targets}
        moments = collect_input_moments(layer, stream, leaders)
        if scale is None:  # input energy of the first layer: a model-wide normalisation for "absolute"
            scale = float(torch.diagonal(next(iter(moments.values())).second_moment).sum())
        for name in targets:
            linear = adapter.get_linear(layer, name)
            accumulator = moments[leader_of[name]]
            moment = accumulator.covariance() if linear.bias is not None else accumulator.second_moment
            items[(index, name)] = RankItem(linear.in_features, linear.out_features,
                                            weighted_spectra(linear.weight, moment, config.damping))
            dense_total += linear.in_features * linear.out_features
        stream = stream.advance(layer)
    budget = (1.0 - config.ratio) * dense_total
    min_ranks = None
    if config.allocation_min_keep > 0:
        min_ranks = {key: rank_for_keep_fraction(item.d_in, item.d_out, config.allocation_min_keep, config.junction)
                     for key, item in items.items()}
    plan = allocate_ranks(items, budget, config.junction, config.allocation_weighting, min_ranks, scale or 1.0)
    used = sum(factor_param_count(items[k].d_in, items[k].d_out, r, config.junction) for k, r in plan.items())
    keep_by_name = {}
    for name in targets:
        keys = [k for k in plan if k[1] == name]
        kept = sum(factor_param_count(items[k].d_in, items[k].d_out, plan[k], config.junction) for k in keys)
        keep_by_name[name] = kept / sum(items[k].d_in * items[k].d_out for k in keys)
    log.info("global allocation: %d of %.0f budget parameters; keep fraction by projection %s", used, budget,
             {k: round(v, 3) for k, v in keep_by_name.items()})
    return plan, {"allocation_budget": budget, "allocation_used": used, "keep_fraction_by_projection": keep_by_name}
