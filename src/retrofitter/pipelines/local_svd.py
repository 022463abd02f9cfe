"""Local activation-aware SVD of each projection: the per-layer strategy of the svd / asvd-* / svd-llm methods.

Each target W [d', d] becomes a ``LatentLinear`` of its planned rank r from the weighted SVD of its target
map T [d', d] in the metric C [d, d] of its input (float64; P from C by ``config.preconditioner``,
design.md §3). The layer's statistics (``LayerContext.statistics``, pipelines/layer_statistics.py) decide
what T and C are (pipelines/input_statistics.py):

* statistics "compressed", "teacher" or precomputed: T = W, C = E[x xᵀ] of the input x;
* ``statistics="teacher_target"``: the fit reproduces the *original* model's output W x_t from the
  compressed model's input x_c (linalg/teacher_target.py), T = W̃ = W + W(C_tc − C_cc)(damped C_cc)⁻¹ with
  C_tc = E[x_t x_cᵀ], C = C_cc.

With a bias, the fit uses the centered moments (C0 = C − μμᵀ, and Cov(x_t, x_c) in W̃) and the bias is
compensated, b̂ = b + W μ_t − B A μ_c (μ_t = μ_c = μ but with teacher targets). The proxy error is
E‖(T − BA)x‖² / E‖T x‖² in the metric C.

With several processes (pipelines/distributed.py) the fits of a layer (or of a projection group) are
spread over them (``LayerContext.fit_spread``) and every factor is broadcast from the process that made it.

When the statistics are collected (``CompressConfig.refit_within_layer``):
* ``False`` — one pass of the original layer gives the input statistics of every projection group;
* ``True`` — group by group in execution order (q/k/v, o, gate/up, down), each group's input statistics
  are collected after the groups before it in the same layer were replaced (o sees the compressed
  q/k/v, the MLP the compressed attention).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import nn

from ..linalg.svd import WeightedSVD, build_preconditioner, proxy_error
from ..modules.latent_linear import LatentLinear
from .input_statistics import InputMoments, PairedInputMoments
from .sequential import LayerContext

__all__ = ["LocalSVDStrategy", "fit_local", "entry"]


def fit_local(context: LayerContext, name: str, statistics: InputMoments | PairedInputMoments,
              preconditioners: dict | None = None, svd_cache: dict | None = None,
              svd: WeightedSVD | None = None, **extra) -> None:
    """Replace projection ``name`` of the context's layer by its rank-``plan`` fit on ``statistics`` (its input's,
    from ``context.statistics.collect``; module docstring).

    ``preconditioners`` ((id(accumulator), centered) -> (accumulator, P)) lets projections that share an input
    share one eigendecomposition; ``svd_cache`` ((layer, name, preconditioner, damping) -> full weighted SVD)
    lets another ratio of the same model only truncate; ``svd``: this matrix's full weighted SVD on the same
    statistics with ``config``'s preconditioner and damping, computed beforehand (the rank plan's).
    ``extra``: fields of the report entry (the statistics may set ``method``).
    """
    config, linear = context.config, context.linear(name)
    rank = context.plan[(context.index, name)]
    centered = linear.bias is not None  # with a bias, centered statistics (the bias absorbs the mean)
    moment = statistics.moment(centered)
    target = statistics.target(linear.weight, centered, config.damping)
    key = (context.index, name, config.preconditioner, config.damping)
    if svd is None and svd_cache is not None:
        svd = svd_cache.get(key)
    if svd is None:
        def shared_preconditioner():  # one eigendecomposition per input, shared by its projections
            # keyed by id, holding the accumulator too: a freed accumulator's id could be reused
            shared_key = (id(statistics.accumulator), centered)
            _, shared = (preconditioners or {}).get(shared_key, (None, None))
            if shared is None:
                shared = build_preconditioner(moment, linear.in_features, config.preconditioner, config.damping,
                                              context.where(name), linear.weight.device)
                if preconditioners is not None:
                    preconditioners[shared_key] = (statistics.accumulator, shared)
            return shared

        svd = statistics.weighted_svd(target, moment, config.preconditioner, config.damping, shared_preconditioner,
                                      context.where(name))
        if svd_cache is not None:
            svd_cache[key] = svd
    B, A = svd.factors(rank)
    replacement = LatentLinear.from_factors(B, A, bias=statistics.compensated_bias(linear, B, A),
                                            junction=config.junction, dtype=linear.weight.dtype,
                                            device=linear.weight.device)
    context.replace(name, replacement, entry(linear, replacement, proxy_error(target, B, A, moment),
                                             **{**extra, **statistics.entry_fields}))


def entry(linear: nn.Module, replacement: LatentLinear, error: float, **extra) -> dict:
    """The report entry of one replaced projection."""
    return {"rank": replacement.rank, "in": linear.in_features, "out": linear.out_features,
            "params_before": linear.weight.numel(), "params_after": replacement.num_weight_params(),
            "proxy_error": error, **extra}


class LocalSVDStrategy:
    """Per-layer strategy: every target gets its own activation-aware SVD (module docstring).

    ``svd_cache`` (optional dict, shared across runs on the same statistics) keeps each matrix's full
    weighted SVD; used with one statistics pass, not with ``refit_within_layer``. ``known_svds`` (layer
    index -> {name: full weighted SVD}, e.g. ``MomentSpill.weighted_svds``): SVDs made beforehand on the
    precomputed statistics with this config's preconditioner, which the fits truncate.
    """

    def __init__(self, svd_cache: dict | None = None, known_svds: Callable[[int], dict] | None = None):
        self.svd_cache = svd_cache
        self.known_svds = known_svds

    def fit_layer(self, context: LayerContext) -> None:
        """Every planned target fitted on its input's statistics, collected once per projection group (through
        its first planned target): all groups in one pass, or group by group with ``refit_within_layer``."""
        targets = [n for n in context.targets if (context.index, n) in context.plan]  # unplanned: kept dense
        groups = [[n for n in group if n in targets] for group in context.adapter.linear_groups]
        groups = [group for group in groups if group]  # each read by its first target: one input per group
        known = self.known_svds(context.index) if self.known_svds is not None else {}
        preconditioners: dict = {}

        def fits(group: list[str], statistics) -> dict:
            return {name: partial(fit_local, context, name, statistics, preconditioners, self.svd_cache,
                                  known.get(name)) for name in group}

        collect = context.statistics.collect
        if context.config.refit_within_layer:
            for group in groups:
                context.fit_spread(fits(group, collect({group[0]: context.linear(group[0])})[group[0]]))
        else:
            statistics = collect({group[0]: context.linear(group[0]) for group in groups})
            context.fit_spread({name: fit for group in groups
                                for name, fit in fits(group, statistics[group[0]]).items()})

    def finish(self, model: nn.Module, targets: list[str]) -> dict:
        return {}
