"""Local activation-aware SVD of each projection: the per-layer strategy of the svd / asvd-* / svd-llm methods.

Each target W [d', d] with input second moment C (float64) becomes a ``LatentLinear`` of its planned
rank r from the weighted SVD of W P (P from C by ``config.preconditioner``, design.md §3); with a
bias, the fit uses the centered C0 = C − μμᵀ and the bias is compensated, b̂ = b + (W − BA)μ.

With ``statistics="teacher_target"`` each fit reproduces the *original* model's output W x_t from the
compressed model's input x_c instead (linalg/teacher_target.py; :func:`fit_teacher_target`).

With several processes (pipelines/distributed.py) the fits of a layer (or of a projection group) are
spread over them (``LayerContext.fit_spread``) and every factor is broadcast from the process that made it.

Where the statistics come from (``CompressConfig.refit_within_layer``):
* ``False`` — one pass of the original layer gives the input moments of every projection group;
* ``True`` — group by group in execution order (q/k/v, o, gate/up, down), each group's input moments
  are collected after the groups before it in the same layer were replaced (o sees the compressed
  q/k/v, the MLP the compressed attention).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from ..linalg.moments import SecondMomentAccumulator
from ..linalg.svd import WeightedSVD, bias_compensation, build_preconditioner, cheapest_weighted_svd, proxy_error
from ..linalg.teacher_target import teacher_target_factors, teacher_target_map
from ..modules.latent_linear import LatentLinear
from .sequential import LayerContext

__all__ = ["LocalSVDStrategy", "fit_local", "fit_teacher_target", "entry"]


def fit_local(context: LayerContext, name: str, accumulator: SecondMomentAccumulator,
              preconditioners: dict | None = None, svd_cache: dict | None = None,
              svd: WeightedSVD | None = None, **extra) -> None:
    """Replace projection ``name`` of the context's layer by its rank-``plan`` local fit on ``accumulator``.

    ``preconditioners`` (id(accumulator) -> (accumulator, P)) lets projections that share an input share one
    eigendecomposition; ``svd_cache`` ((layer, name, preconditioner, damping) -> full weighted SVD) lets
    another ratio of the same model only truncate; ``svd``: this matrix's full weighted SVD on the same
    statistics with ``config``'s preconditioner and damping, computed beforehand (the rank plan's).
    """
    config, linear = context.config, context.linear(name)
    rank = context.plan[(context.index, name)]
    has_bias = linear.bias is not None
    # centered statistics with a bias (the bias absorbs the mean), raw second moment without
    moment = accumulator.covariance() if has_bias else accumulator.second_moment
    key = (context.index, name, config.preconditioner, config.damping)
    if svd is None and svd_cache is not None:
        svd = svd_cache.get(key)
    if svd is None:
        def shared_preconditioner():  # one eigendecomposition per input, shared by its projections
            # keyed by id, holding the accumulator too: a freed accumulator's id could be reused
            _, shared = (preconditioners or {}).get(id(accumulator), (None, None))
            if shared is None:
                shared = build_preconditioner(moment, linear.in_features, config.preconditioner, config.damping,
                                              context.where(name), linear.weight.device)
                if preconditioners is not None:
                    preconditioners[id(accumulator)] = (accumulator, shared)
            return shared

        svd = cheapest_weighted_svd(linear.weight, moment, config.preconditioner, config.damping,
                                    shared_preconditioner, context.where(name))
        if svd_cache is not None:
            svd_cache[key] = svd
    B, A = svd.factors(rank)
    bias = bias_compensation(linear.weight, B, A, linear.bias.detach(), accumulator.mean) if has_bias else None
    replacement = LatentLinear.from_factors(B, A, bias=bias, junction=config.junction, dtype=linear.weight.dtype,
                                            device=linear.weight.device)
    context.replace(name, replacement, entry(linear, replacement, proxy_error(linear.weight, B, A, moment), **extra))


def fit_teacher_target(context: LayerContext, name: str, statistics: tuple, preconditioners: dict | None = None) -> None:
    """Replace projection ``name`` by its rank-``plan`` fit of the teacher's output W x_t from the compressed
    input x_c (linalg/teacher_target.py); ``statistics`` = (C_cc accumulator, mean of x_t, E[x_t x_cᵀ]).

    With a bias both streams are centered (Cov(x_c), Cov(x_t, x_c)) and b̂ = b + W μ_t − B A μ_c.
    ``preconditioners`` ((id(accumulator), centered) -> (accumulator, P)) shares one eigendecomposition
    between projections of one input.
    """
    config, linear = context.config, context.linear(name)
    moment_c, mean_t, cross = statistics
    rank = context.plan[(context.index, name)]
    has_bias = linear.bias is not None
    moment = moment_c.covariance() if has_bias else moment_c.second_moment
    cross_moment = cross.cross_moment - torch.outer(mean_t, moment_c.mean) if has_bias else cross.cross_moment
    key = (id(moment_c), has_bias)  # the accumulator is held in the value: its id cannot be reused meanwhile
    _, shared = (preconditioners or {}).get(key, (None, None))
    if shared is None:
        shared = build_preconditioner(moment, linear.in_features, config.preconditioner, config.damping,
                                      context.where(name), linear.weight.device)
        if preconditioners is not None:
            preconditioners[key] = (moment_c, shared)
    B, A = teacher_target_factors(linear.weight, cross_moment, moment, rank, config.damping, shared)
    bias = None
    if has_bias:
        weight = linear.weight.detach().to(torch.float64)
        bias = linear.bias.detach().to(weight) + weight @ mean_t.to(weight) - B @ (A @ moment_c.mean.to(weight))
    replacement = LatentLinear.from_factors(B, A, bias=bias, junction=config.junction, dtype=linear.weight.dtype,
                                            device=linear.weight.device)
    target = teacher_target_map(linear.weight, cross_moment, moment, config.damping)
    context.replace(name, replacement, entry(linear, replacement, proxy_error(target, B, A, moment),
                                             method="teacher_target"))


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
        adapter = context.adapter
        targets = [n for n in context.targets if (context.index, n) in context.plan]  # unplanned: kept dense
        groups = [[n for n in group if n in targets] for group in adapter.linear_groups]
        groups = [(group, leader) for group, leader in zip(groups, (g[0] for g in adapter.linear_groups)) if group]
        preconditioners: dict = {}
        if context.precomputed is not None:  # layer index -> name -> accumulator, computed beforehand
            known = self.known_svds(context.index) if self.known_svds is not None else {}
            context.fit_spread({name: partial(fit_local, context, name, context.precomputed[name], preconditioners,
                                              self.svd_cache, known.get(name)) for group, _ in groups for name in group})
            return
        if context.config.statistics == "teacher_target":
            collect = context.paired_moments
            fit = lambda ctx, name, stats: fit_teacher_target(ctx, name, stats, preconditioners)  # noqa: E731
        else:
            collect = context.moments
            fit = lambda ctx, name, stats: fit_local(ctx, name, stats, preconditioners, self.svd_cache)  # noqa: E731
        if context.config.refit_within_layer:
            for group, leader in groups:
                statistics = collect({leader: context.linear(leader)})[leader]
                context.fit_spread({name: partial(fit, context, name, statistics) for name in group})
        else:
            statistics = collect({leader: context.linear(leader) for _, leader in groups})
            context.fit_spread({name: partial(fit, context, name, statistics[leader])
                                for group, leader in groups for name in group})

    def finish(self, model: nn.Module, targets: list[str]) -> dict:
        return {}
