"""Rank plans: (layer index, projection name) -> rank, for the sequential loop (``CompressConfig.allocation``).

``uniform``: every target matrix keeps (1 − ratio) of its parameters (:func:`uniform_plan`).

``global``: one parameter budget for all matrices (:func:`global_plan`), described below.

For every target matrix m (W_m [d'_m, d_m], input second moment C_m from one teacher pass over the
calibration stream — all layers in one sweep, moments discarded after each layer) the weighted
spectrum σ_{m,1} ≥ σ_{m,2} ≥ ... of W_m C_m^{1/2} gives the rootcov error of rank r exactly:
E‖(W_m − Ŵ_m) x‖² = Σ_{i>r} σ_{m,i}². With a junction a rank step r → r+1 costs d_m + d'_m − (2r + 1)
parameters. Greedy water-filling:

    start every matrix at its minimum rank; repeatedly take the step with the largest
    gain/cost = w_m(σ²_{m,r+1}) / cost_m(r) that still fits in the budget: the parameters uniform
    allocation stores at this ratio (≤ (1 − ratio)·Σ_m d_m d'_m)

until no step fits, so the plan uses the budget up to less than one rank step of one matrix.
The gain weighting w (``WEIGHTINGS``) decides how errors of different matrices are compared:
``relative`` σ²/Σσ² (each matrix's relative output error counts the same), ``absolute`` σ²/E‖x_0‖²
(output error energy, normalised by the model's input energy only), ``sqrt_relative`` (relative error
gains flattened by a square root: a compromise that spreads ranks more evenly), ``fisher`` f_m σ²:
the output error energy priced by how much the loss reacts to that matrix's output,

    f_m = Σ_t ‖∂L/∂y_{m,t}‖² / (T · d'_m),   L = Σ_t −log p(u_{t+1} | u_{≤t})  (summed, T tokens)

so that, with the isotropic empirical-Fisher approximation E[δyᵀ F δy] ≈ f_m E‖δy‖², the gain of a
rank step estimates the loss increase (nats per token, up to a common factor ½) it prevents. f_m
comes from a few backward passes of the original model (``allocation_gradient_blocks`` blocks).
"""

from __future__ import annotations

import heapq
import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..config import CompressConfig
from ..eval.resources import release_free_heap_memory
from ..linalg.moments import damped
from ..linalg.preconditioners import symmetric_power
from ..linalg.ranks import factor_param_count, max_useful_rank, rank_for_keep_fraction, rank_for_ratio
from ..linalg.svd import build_preconditioner, cheapest_weighted_svd, output_side_svd, uses_output_side
from .calibration import LayerStream, collect_input_moments
from .distributed import SINGLE_PROCESS, DataParallel
from .gradient_importance import output_gradient_importance
from .latency_allocation import latency_plan

__all__ = ["RankItem", "WEIGHTINGS", "RANK_PLANS", "KV_PRICE_MULTIPLES", "allocate_ranks", "allocate_with_kv_budget",
           "kept_gain", "weighted_spectra", "damped_root", "uniform_plan", "global_plan",
           "plan_from_items", "make_planner"]

log = logging.getLogger(__name__)


@dataclass
class RankItem:
    """One matrix: input/output dims, σ² of W C^{1/2} (float64, descending) and its loss sensitivity
    ``importance`` f_m (mean squared loss gradient per output coordinate; used by ``fisher``)."""

    d_in: int
    d_out: int
    energies: torch.Tensor
    importance: float = 1.0


def _relative(item: RankItem, _scale: float) -> torch.Tensor:
    return item.energies / item.energies.sum().clamp_min(torch.finfo(item.energies.dtype).tiny)


def _absolute(item: RankItem, scale: float) -> torch.Tensor:
    return item.energies / scale


def _sqrt_relative(item: RankItem, scale: float) -> torch.Tensor:
    return _relative(item, scale).sqrt()


def _fisher(item: RankItem, _scale: float) -> torch.Tensor:
    return item.energies * item.importance


WEIGHTINGS: dict[str, Callable[[RankItem, float], torch.Tensor]] = {
    "relative": _relative,
    "absolute": _absolute,
    "sqrt_relative": _sqrt_relative,
    "fisher": _fisher,
}


def _step_cost(item: RankItem, rank: int, junction: bool) -> int:
    """Parameters added by rank → rank + 1."""
    return factor_param_count(item.d_in, item.d_out, rank + 1, junction) - factor_param_count(
        item.d_in, item.d_out, rank, junction)


def allocate_ranks(items: dict, budget: float, junction: bool = True, weighting: str = "relative",
                   min_ranks: dict | None = None, scale: float = 1.0, kv_keys=frozenset(),
                   kv_budget: float | None = None, kv_price: float = 0.0) -> dict:
    """Greedy water-filling (module docstring): key -> rank with Σ params ≤ budget.

    ``min_ranks`` (key -> rank, default 1) are granted first; ``ValueError`` if they alone exceed the budget.
    Second budget (design.md §6): the ranks of ``kv_keys`` (latent k/v widths: each rank is one cached number
    per token) sum to at most ``kv_budget``; a rank step of such a matrix is priced Δp + ``kv_price`` (μ Δk).
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"unknown allocation weighting {weighting!r}; choose from {sorted(WEIGHTINGS)}")
    ranks = {key: max(1, (min_ranks or {}).get(key, 1)) for key in items}
    used = sum(factor_param_count(item.d_in, item.d_out, ranks[key], junction) for key, item in items.items())
    if used > budget:
        raise ValueError(f"the minimum ranks alone need {used} parameters, more than the budget {budget:.0f}")
    kv_used = sum(ranks[key] for key in kv_keys)
    if kv_budget is not None and kv_used > kv_budget:
        raise ValueError(f"the minimum k/v ranks alone cache {kv_used} numbers per token, more than the KV budget "
                         f"{kv_budget:.0f}")
    gains = {key: WEIGHTINGS[weighting](item, scale).to(torch.float64).tolist() for key, item in items.items()}
    limits = {key: min(max_useful_rank(item.d_in, item.d_out, junction), len(gains[key])) for key, item in items.items()}
    heap: list = []

    def push(key):
        rank = ranks[key]
        if rank < limits[key]:
            cost = _step_cost(items[key], rank, junction)
            price = cost + (kv_price if key in kv_keys else 0.0)
            heapq.heappush(heap, (-gains[key][rank] / price, cost, str(key), key))

    for key in items:
        push(key)
    while heap:
        _, cost, _, key = heapq.heappop(heap)
        if used + cost > budget:
            continue  # this matrix cannot grow any more within the budget
        if key in kv_keys and kv_budget is not None and kv_used + 1 > kv_budget:
            continue  # nor within the KV budget
        ranks[key] += 1
        used += cost
        kv_used += key in kv_keys
        push(key)
    return ranks


def kept_gain(items: dict, plan: dict, weighting: str, scale: float = 1.0) -> float:
    """Σ_m Σ_{i < r_m} g_m(i): the weighted error the plan keeps (what the greedy maximises)."""
    return sum(float(WEIGHTINGS[weighting](items[key], scale)[:rank].sum()) for key, rank in plan.items())


# Lagrange prices μ tried for a rank step of k/v, in units of the median parameter cost of a rank step
KV_PRICE_MULTIPLES = (0.0, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)


def allocate_with_kv_budget(items: dict, budget: float, config: CompressConfig, min_ranks, scale: float):
    """Both budgets (design.md §6): parameters ≤ ``budget`` and Σ latent k/v widths ≤ kv_ratio × the
    original's k/v numbers per token. Each μ of ``KV_PRICE_MULTIPLES`` gives a greedy plan that meets both
    (the KV budget as a hard limit); the plan keeping the most weighted error wins. Returns (plan, report)."""
    kv_keys = frozenset(key for key in items if key[1] in ("k", "v"))
    if not kv_keys:
        raise ValueError("--kv-ratio budgets the latent k/v cache: k and v must be among the compressed targets")
    full = sum(items[key].d_out for key in kv_keys)  # n_kv · d_h per layer, for k and for v
    kv_budget = math.floor(config.options.kv_ratio * full)
    unit = float(torch.tensor([_step_cost(item, 1, config.junction) for item in items.values()]).median())
    best = None
    for multiple in KV_PRICE_MULTIPLES:
        plan = allocate_ranks(items, budget, config.junction, config.allocation_weighting, min_ranks, scale,
                              kv_keys, kv_budget, multiple * unit)
        value = kept_gain(items, plan, config.allocation_weighting, scale)
        if best is None or value > best[0]:
            best = (value, multiple, plan)
    _, multiple, plan = best
    return plan, {"kv_budget_numbers": kv_budget, "kv_original_numbers": full,
                  "kv_used_numbers": sum(plan[key] for key in kv_keys), "kv_price_multiple": multiple}


def weighted_spectra(weight: torch.Tensor, moment: torch.Tensor, damping: float,
                     root: torch.Tensor | None = None) -> torch.Tensor:
    """σ² of W (damped C)^{1/2}, descending [min(d', d)] (float64); ``root``: (damped C)^{1/2} if already known."""
    if root is None:
        root = damped_root(moment, damping)
    return torch.linalg.svdvals(weight.detach().to(root) @ root).pow(2)


def damped_root(moment: torch.Tensor, damping: float) -> torch.Tensor:
    """(C + damping·mean(diag C)·I)^{1/2} [d, d] (float64)."""
    root, _ = symmetric_power(damped(moment.to(torch.float64), damping), 0.5)
    return root


def uniform_plan(model: nn.Module, adapter, config: CompressConfig, targets: list[str]) -> dict:
    """Every target matrix keeps (1 − ratio) of its parameters: the largest rank whose stored factors
    (r(d+d') − r² with a junction, r(d+d') without) fit in (1 − ratio)·d·d'."""
    plan = {}
    for index, layer in enumerate(adapter.decoder_layers(model)):
        for name in targets:
            linear = adapter.get_linear(layer, name)
            try:
                plan[(index, name)] = rank_for_ratio(linear.in_features, linear.out_features, config.ratio,
                                                     junction=config.junction)
            except ValueError as error:
                raise ValueError(f"layer {index} {name} ({linear.out_features}x{linear.in_features}): {error}") from None
    return plan


@torch.no_grad()
def global_plan(model: nn.Module, adapter, config: CompressConfig, stream: LayerStream,
                targets: list[str], calibration: torch.Tensor | None = None,
                parallel: DataParallel = SINGLE_PROCESS, forms=None, keep_moments=None) -> tuple[dict, dict]:
    """One teacher pass over all layers → weighted spectra → greedy plan. Returns (plan, report).

    ``calibration`` (token blocks) is needed by the ``fisher`` weighting (its backward passes). With several
    processes (``parallel``, each with its share of the ``stream``) the moments and the gradient sums are
    all-reduced, so every process makes the plan of all the blocks. ``forms`` (a ``form_choice.FormChoice``):
    the cost model of ``budget="latency"``. ``keep_moments(index, {name: accumulator}, {name: WeightedSVD})``,
    if given, receives every layer's input moments of the targets (pipelines/moment_spill.py: the fits reuse
    them) and, when the fits' preconditioner is rootcov (the plan's), each matrix's full weighted SVD, whose
    singular values are the spectrum: the fits then only truncate it (otherwise the second mapping is empty).
    """
    layers = adapter.decoder_layers(model)
    importance = {}
    if config.allocation_weighting == "fisher":
        if calibration is None:
            raise ValueError("the 'fisher' allocation weighting needs the calibration token blocks")
        importance = output_gradient_importance(model, adapter, calibration, targets, config.allocation_gradient_blocks,
                                                parallel)
    leader_of = {name: group[0] for group in adapter.linear_groups for name in group}
    items: dict = {}
    scale = None
    for index, layer in enumerate(layers):
        leaders = {leader_of[n]: adapter.get_linear(layer, leader_of[n]) for n in targets}
        moments, stream = collect_input_moments(layer, stream, leaders, keep_outputs=True)  # one pass: both
        for accumulator in moments.values():
            accumulator.synchronize(parallel.all_reduce_sum)
        if scale is None:  # input energy of the first layer: a model-wide normalisation for "absolute"
            scale = float(torch.diagonal(next(iter(moments.values())).second_moment).sum())
        svds = {}  # name -> the full weighted SVD of W (damped C)^{1/2}, for the fits (keep_moments)
        roots: dict = {}  # (leader, centered) -> damped root: one eigendecomposition per distinct input
        for name in targets:
            linear = adapter.get_linear(layer, name)
            accumulator = moments[leader_of[name]]
            centered = linear.bias is not None
            moment = accumulator.covariance() if centered else accumulator.second_moment
            key = (leader_of[name], centered)
            where = f"layer {index} {name}"
            if keep_moments is not None and config.preconditioner == "rootcov":  # the fits' own SVD, kept
                def shared_root(key=key, moment=moment, linear=linear, where=where):  # (P, P⁺) once per input
                    if key not in roots:  # the fit's own computation, bit for bit
                        roots[key] = build_preconditioner(moment, linear.in_features, "rootcov", config.damping,
                                                          where, linear.weight.device)
                    return roots[key]

                svds[name] = cheapest_weighted_svd(linear.weight, moment, "rootcov", config.damping, shared_root,
                                                   where)
                energies = svds[name].S.pow(2)
            elif uses_output_side(linear.out_features, linear.in_features, "rootcov", config.damping):
                energies = output_side_svd(linear.weight, moment, config.damping, where).S.pow(2)  # no d×d root
            else:
                if key not in roots:
                    roots[key] = damped_root(moment, config.damping)
                energies = weighted_spectra(linear.weight, moment, config.damping, roots[key])
            items[(index, name)] = RankItem(linear.in_features, linear.out_features, energies,
                                            importance.get((index, name), 1.0))
        if keep_moments is not None:
            keep_moments(index, {name: moments[leader_of[name]] for name in targets}, svds)
        del moments, svds, roots
        release_free_heap_memory()  # this layer's float64 temporaries: back to the OS before the next layer's
    return plan_from_items(items, config, scale or 1.0, importance, forms)


def plan_from_items(items: dict, config: CompressConfig, scale: float = 1.0, importance: dict | None = None,
                    forms=None) -> tuple[dict, dict]:
    """Greedy plan for ``items`` ((layer, name) -> RankItem) with the parameter budget of uniform allocation
    at ``config.ratio`` (≤ (1 − ratio) of the dense parameters).

    Shared by :func:`global_plan` (spectra from one stream pass) and by callers that already hold the
    weighted spectra (e.g. the singular values of cached rootcov SVDs). Returns ``(plan, report)``.
    ``budget="latency"``: the plan of pipelines/latency_allocation.py with the cost model of ``forms``.
    """
    # The budget is what uniform allocation stores at this ratio (each rank rounded down), so that a
    # global plan is compared with uniform at the same parameter count, never with more.
    budget = sum(factor_param_count(item.d_in, item.d_out,
                                    rank_for_ratio(item.d_in, item.d_out, config.ratio, config.junction),
                                    config.junction) for item in items.values())
    min_ranks = None
    if config.allocation_min_keep > 0:
        min_ranks = {key: rank_for_keep_fraction(item.d_in, item.d_out, config.allocation_min_keep, config.junction)
                     for key, item in items.items()}
    if config.options.budget == "latency":
        if forms is None:
            raise ValueError("--budget latency needs the cost model of the factor forms (pipelines/form_choice.py)")
        gains = {key: WEIGHTINGS[config.allocation_weighting](item, scale).to(torch.float64).tolist()
                 for key, item in items.items()}
        return latency_plan(items, config, forms, gains, min_ranks)
    kv_report = {}
    if config.options.kv_ratio is not None:
        plan, kv_report = allocate_with_kv_budget(items, budget, config, min_ranks, scale)
    else:
        plan = allocate_ranks(items, budget, config.junction, config.allocation_weighting, min_ranks, scale)
    used = sum(factor_param_count(items[k].d_in, items[k].d_out, r, config.junction) for k, r in plan.items())
    keep_by_name = {}
    for name in sorted({name for _, name in items}):
        keys = [k for k in plan if k[1] == name]
        kept = sum(factor_param_count(items[k].d_in, items[k].d_out, plan[k], config.junction) for k in keys)
        keep_by_name[name] = kept / sum(items[k].d_in * items[k].d_out for k in keys)
    log.info("global allocation: %d of %.0f budget parameters; keep fraction by projection %s", used, budget,
             {k: round(v, 3) for k, v in keep_by_name.items()})
    report = {"allocation_budget": budget, "allocation_used": used, "keep_fraction_by_projection": keep_by_name,
              "keep_fraction_by_layer": _keep_by_layer(items, plan, config.junction), **kv_report}
    if importance:
        report["output_gradient_importance"] = {f"{i}.{n}": f for (i, n), f in sorted(importance.items())}
    return plan, report


def _keep_by_layer(items: dict, plan: dict, junction: bool) -> list[float]:
    """Fraction of each layer's dense target parameters that the plan keeps."""
    layers = sorted({index for index, _ in items})
    result = []
    for layer in layers:
        keys = [k for k in items if k[0] == layer]
        kept = sum(factor_param_count(items[k].d_in, items[k].d_out, plan[k], junction) for k in keys)
        result.append(kept / sum(items[k].d_in * items[k].d_out for k in keys))
    return result


def _uniform_planner(model, adapter, config, targets, calibration, parallel, forms=None, keep_moments=None):
    return lambda _stream: (uniform_plan(model, adapter, config, targets), {"allocation": "uniform"})


def _global_planner(model, adapter, config, targets, calibration, parallel, forms=None, keep_moments=None):
    def plan(stream: LayerStream | None):
        if stream is None:
            raise ValueError("global allocation needs the calibration stream (or a plan computed beforehand)")
        result, report = global_plan(model, adapter, config, stream, targets, calibration, parallel, forms,
                                     keep_moments)
        return result, {"allocation": "global", **report}
    return plan


# CompressConfig.allocation -> planner factory (model, adapter, config, targets, calibration, parallel, forms,
# keep_moments) -> Planner; only the global plan makes a statistics pass, so only it calls keep_moments
RANK_PLANS: dict[str, Callable] = {"uniform": _uniform_planner, "global": _global_planner}


def make_planner(model: nn.Module, adapter, config: CompressConfig, targets: list[str],
                 calibration: torch.Tensor | None, parallel: DataParallel = SINGLE_PROCESS, forms=None,
                 keep_moments=None):
    """The planner of ``config.allocation``: called by the loop with the captured stream, returns (plan, report).
    ``forms``: the cost model of ``budget="latency"`` (pipelines/form_choice.py); ``keep_moments``: see
    :func:`global_plan`."""
    return RANK_PLANS[config.allocation](model, adapter, config, targets, calibration, parallel, forms, keep_moments)
