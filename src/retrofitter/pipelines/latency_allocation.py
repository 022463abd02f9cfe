"""Global rank allocation priced in modelled time (``LocalSVDOptions.budget = "latency"``).

Each matrix m is either factored at rank r, taking f_m(r) seconds (the fastest allowed factored form at r,
``FormChoice.best_factored``: a cost model timed on this machine), or kept dense (the original W_m, D_m
seconds, no error). With the gains g_m(i) of allocation.py (the weighted error a rank step removes) the
greedy water-filling of the parameter budget becomes

    start every matrix at its minimum rank, dense at once where D_m ≤ f_m(r_min) (faster and exact);
    repeatedly take the move with the largest gain / Δt that fits in the time budget T:
        a rank step r → r+1:  gain g_m(r),            Δt = f_m(r+1) − f_m(r)
        going dense:          gain Σ_{i ≥ r} g_m(i),   Δt = D_m − f_m(r)    (free when f_m(r) ≥ D_m)

T is the modelled time of the uniform plan at ``ratio`` in the configured form (``--junction``), so a
latency plan is compared with uniform allocation at equal modelled time. A rank step of zero price (flat
stretch of a measured curve) is priced ``MIN_STEP_SECONDS``. Pure: curves and gains in, plan out.
"""

from __future__ import annotations

import heapq

from ..linalg.ranks import factor_param_count, rank_for_ratio

__all__ = ["MIN_STEP_SECONDS", "allocate_time", "latency_plan"]

MIN_STEP_SECONDS = 1e-12


def allocate_time(gains: dict, factored: dict, dense: dict, budget: float, min_ranks: dict | None = None
                  ) -> tuple[dict, set]:
    """Greedy plan (module docstring): returns (key -> rank of the factored matrices, keys kept dense).

    ``gains``: key -> [g(0), g(1), ...] (gain of the step r → r+1 at index r); ``factored``: key -> [f(0),
    f(1), ..., f(limit)] seconds at each rank (index = rank; ranks above ``limit`` are not considered);
    ``dense``: key -> D seconds. Raises ``ValueError`` when the minimum ranks alone exceed ``budget``.
    """
    ranks = {key: max(1, (min_ranks or {}).get(key, 1)) for key in gains}
    dense_keys: set = set()
    for key in gains:
        if dense[key] <= factored[key][min(ranks[key], len(factored[key]) - 1)]:
            dense_keys.add(key)  # dense runs no slower than the smallest factored form: keep W exactly
    used = sum(dense[k] if k in dense_keys else factored[k][ranks[k]] for k in gains)
    if used > budget:
        raise ValueError(f"the minimum ranks alone take {used:.4g} s of modelled time, more than the budget "
                         f"{budget:.4g} s")
    remaining = {key: _suffix_sums(values) for key, values in gains.items()}
    heap: list = []

    def push(key):
        rank, curve = ranks[key], factored[key]
        if rank + 1 < len(curve) and rank < len(gains[key]):
            cost = max(curve[rank + 1] - curve[rank], MIN_STEP_SECONDS)
            heapq.heappush(heap, (-gains[key][rank] / cost, str(key), "step", rank, key, cost))
        cost = max(dense[key] - curve[rank], MIN_STEP_SECONDS)
        gain = remaining[key][rank] if rank < len(remaining[key]) else 0.0
        heapq.heappush(heap, (-gain / cost, str(key), "dense", rank, key, dense[key] - curve[rank]))

    for key in gains:
        if key not in dense_keys:
            push(key)
    while heap:
        _, _, move, rank, key, cost = heapq.heappop(heap)
        if key in dense_keys or rank != ranks[key] or used + cost > budget:
            continue  # stale (the matrix moved since), or it does not fit: time only grows
        used += cost
        if move == "dense":
            dense_keys.add(key)
        else:
            ranks[key] += 1
            push(key)
    return {key: rank for key, rank in ranks.items() if key not in dense_keys}, dense_keys


def _suffix_sums(values) -> list[float]:
    """[Σ_{i ≥ 0} v_i, Σ_{i ≥ 1} v_i, ...]."""
    result, total = [0.0] * len(values), 0.0
    for index in range(len(values) - 1, -1, -1):
        total += float(values[index])
        result[index] = total
    return result


def latency_plan(items: dict, config, forms, gains: dict, min_ranks: dict | None) -> tuple[dict, dict]:
    """The latency plan of ``items`` ((layer, name) -> allocation.RankItem) with ``forms`` (a
    ``form_choice.FormChoice``) and the gains of ``config.allocation_weighting``; returns (plan, report).

    Only factored matrices are in the plan; the report lists the dense ones (``dense_kept``), the time
    budget and the modelled time and stored parameters of the plan in its chosen forms.
    """
    factored, dense, budget, curves = {}, {}, 0.0, {}
    for key, item in items.items():
        limit = min(min(item.d_in, item.d_out) - 1, len(gains[key]))
        shape = (forms.pivots_lead(key[1]), item.d_in, item.d_out, limit)  # matrices of one shape share a curve
        if shape not in curves:
            curves[shape] = [0.0] + [forms.best_factored(key[1], item.d_in, item.d_out, r)[1]
                                     for r in range(1, limit + 1)]
        factored[key] = curves[shape]
        dense[key] = forms.dense_seconds(item.d_in, item.d_out)
        uniform = rank_for_ratio(item.d_in, item.d_out, config.ratio, config.junction)
        budget += forms.configured_seconds(key[1], item.d_in, item.d_out, uniform)
    plan, dense_keys = allocate_time(gains, factored, dense, budget, min_ranks)
    chosen = {key: forms.best_factored(key[1], items[key].d_in, items[key].d_out, rank) for key, rank in plan.items()}
    used = sum(seconds for _, seconds in chosen.values()) + sum(dense[key] for key in dense_keys)
    params = sum(factor_param_count(items[k].d_in, items[k].d_out, plan[k], form == "junction")
                 for k, (form, _) in chosen.items()) + sum(items[k].d_in * items[k].d_out for k in dense_keys)
    report = {"budget": "latency", "time_budget_s": budget, "time_used_s": used,
              "time_dense_s": sum(dense.values()), "params_after": params,
              "params_before": sum(item.d_in * item.d_out for item in items.values()),
              "dense_kept": [f"{i}.{n}" for i, n in sorted(dense_keys)],
              "forms": {f"{i}.{n}": form for (i, n), (form, _) in sorted(chosen.items())}}
    return plan, report
