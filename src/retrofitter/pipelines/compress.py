"""``compress``: the sequential loop (pipelines/sequential.py) with a rank plan and a per-layer strategy.

    strategy = STRATEGIES[type(config.options)](config, svd_cache)   # local SVD family or LatentLLM
    planner  = allocation.make_planner(...)              # uniform or global ranks
    run_sequential(model, config, strategy, planner, calibration=...)

Besides the calibration stream, the loop can run on statistics computed beforehand
(:func:`collect_teacher_moments`, one pass of the original model): :func:`compress_with_moments`
then compresses several ratios or plans of one model from the same statistics, reusing each matrix's
weighted SVD (``svd_cache``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..adapters import adapter_for
from ..config import CompressConfig, LatentLLMOptions, LocalSVDOptions
from .allocation import RankItem, make_planner, plan_from_items
from .calibration import capture_stream, collect_input_moments
from .distributed import SINGLE_PROCESS, DataParallel
from .gradient_importance import output_gradient_importance
from .form_choice import form_choice_for, forms_summary, needs_form_choice
from .latentllm import LatentLLMStrategy
from .local_svd import LocalSVDStrategy
from .moment_spill import MomentSpill
from .sequential import CalibrationError, run_sequential, target_names

__all__ = ["STRATEGIES", "CalibrationError", "strategy_for", "compress_model", "collect_teacher_moments",
           "compress_with_moments", "weighted_spectra_from_cache", "teacher_global_plan", "reuses_plan_statistics"]

# the method's options class (config/methods.py) -> factory (config, svd_cache) -> LayerStrategy
STRATEGIES = {
    LocalSVDOptions: lambda config, svd_cache: LocalSVDStrategy(svd_cache),
    LatentLLMOptions: lambda config, svd_cache: LatentLLMStrategy(config),
}


def strategy_for(config: CompressConfig, svd_cache: dict | None = None):
    """The per-layer strategy of ``config.method`` (a ``sequential.LayerStrategy``), by its options class."""
    return STRATEGIES[type(config.options)](config, svd_cache)


def is_local(config: CompressConfig) -> bool:
    """Whether the method fits every projection on its own (svd / asvd-* / svd-llm: ``LocalSVDOptions``)."""
    return isinstance(config.options, LocalSVDOptions)


def compress_model(model: nn.Module, config: CompressConfig, calibration: torch.Tensor, progress: bool = True,
                   checkpoint_dir=None, remove_checkpoint: bool = True, parallel: DataParallel = SINGLE_PROCESS,
                   offload=None) -> tuple[nn.Module, dict]:
    """Compress ``model`` in place on calibration token blocks [n, seq_len]; returns ``(model, report)``.

    ``checkpoint_dir`` makes the run resumable (pipelines/resume.py); it is removed on success unless
    ``remove_checkpoint`` is False. ``parallel``: data-parallel calibration over the processes of a
    ``torchrun`` launch (pipelines/distributed.py; every process passes the same blocks); ``offload``: a
    meta-device model read layer by layer (pipelines/offload.py, see ``compress_out_of_core``).
    """
    adapter = adapter_for(model)
    targets = target_names(adapter, config)
    forms = None
    if needs_form_choice(config):  # --factor-forms fastest / --budget latency: a cost model timed here (cached)
        if parallel.active or offload is not None:
            raise ValueError("--factor-forms fastest and --budget latency run in one process with the model in "
                             "memory (not with torchrun or out of core yet)")
        forms = form_choice_for(model, adapter, config, targets, progress)
    spill = None
    if reuses_plan_statistics(config, parallel, offload, forms):  # one statistics pass instead of two
        spill = MomentSpill(None if checkpoint_dir is None else Path(checkpoint_dir).parent,
                            device=next(model.parameters()).device)
    # with the spill, the fits truncate the weighted SVDs the plan computed for its spectra (rootcov)
    strategy = (LocalSVDStrategy(known_svds=spill.weighted_svds) if spill is not None
                else strategy_for(config))
    try:
        planner = make_planner(model, adapter, config, targets, calibration, parallel, forms,
                               keep_moments=None if spill is None else spill.put)
        model, report = run_sequential(model, config, strategy, planner, calibration=calibration, progress=progress,
                                       checkpoint_dir=checkpoint_dir, remove_checkpoint=remove_checkpoint,
                                       offload=offload, parallel=parallel, forms=forms, precomputed=spill)
    finally:
        if spill is not None:
            spill.close()
    report["statistics_passes"] = 1 if spill is not None else None
    report["statistics_spill_bytes"] = spill.bytes_written if spill is not None else None  # temporary, on disk
    if forms is not None:
        report["factor_forms"] = forms_summary(report["layers"], forms)
    return model, report


def reuses_plan_statistics(config: CompressConfig, parallel: DataParallel = SINGLE_PROCESS, offload=None,
                           forms=None) -> bool:
    """Whether the fits read the global plan's statistics (pipelines/moment_spill.py) instead of a second pass:
    teacher statistics (the plan's pass sees exactly the fits' inputs), a local method, in one process with
    the model in memory and the parameter budget's factor forms."""
    return (is_local(config) and config.statistics == "teacher" and config.allocation == "global"
            and not config.refit_within_layer and not parallel.active and offload is None and forms is None)


@torch.no_grad()
def collect_teacher_moments(model: nn.Module, calibration: torch.Tensor, batch_size: int = 8,
                            progress: bool = True) -> dict[int, dict[str, object]]:
    """Input second moments of every projection of the *original* model, all layers, one pass.

    Returns layer index -> projection name -> ``SecondMomentAccumulator`` (projections sharing an
    input share one accumulator). Lets several compressions (methods × ratios) of one model reuse a
    single statistics pass. Memory: one d×d float64 matrix per distinct input per layer.
    """
    adapter = adapter_for(model)
    stream = capture_stream(model, adapter, calibration, batch_size)
    result = {}
    layers = adapter.decoder_layers(model)
    for index in tqdm(range(len(layers)), desc="statistics", disable=not progress):
        layer = layers[index]
        leaders = {group[0]: adapter.get_linear(layer, group[0]) for group in adapter.linear_groups}
        moments, stream = collect_input_moments(layer, stream, leaders, keep_outputs=True)
        result[index] = {name: moments[group[0]] for group in adapter.linear_groups for name in group}
    return result


def compress_with_moments(model: nn.Module, config: CompressConfig, moments: dict[int, dict],
                          svd_cache: dict | None = None, plan: dict | None = None) -> tuple[nn.Module, dict]:
    """Local compression of every layer from precomputed (teacher) moments; returns ``(model, report)``.

    Pass the same ``svd_cache`` dict to several calls (other ratios of the same model and method) to
    reuse each matrix's weighted SVD. ``plan`` ((layer, name) -> rank) overrides the uniform plan,
    e.g. a global one from :func:`teacher_global_plan`. Precomputed statistics are one pass of the
    original model, so ``refit_within_layer`` does not apply.
    """
    if not is_local(config):
        raise ValueError(f"method {config.method!r} needs the calibration stream; precomputed moments serve the "
                         f"local methods only")
    if needs_form_choice(config):
        raise ValueError("--factor-forms fastest and --budget latency run with the calibration stream "
                         "(compress_model), not on precomputed statistics yet")
    adapter = adapter_for(model)
    targets = target_names(adapter, config)
    if plan is None:
        planner = make_planner(model, adapter, dataclasses.replace(config, allocation="uniform"), targets, None)
    else:
        planner = lambda _stream: (plan, {"allocation": "given"})  # noqa: E731
    return run_sequential(model, config, LocalSVDStrategy(svd_cache), planner, precomputed=moments, progress=False)


def weighted_spectra_from_cache(model: nn.Module, config: CompressConfig, svd_cache: dict) -> dict:
    """(layer, name) -> ``allocation.RankItem`` from the singular values S of cached weighted SVDs.

    For rootcov, S² is the exact output-error spectrum (allocation.py); ``svd_cache`` must hold every
    target matrix (fill it with one ``compress_with_moments`` call at any ratio).
    """
    adapter = adapter_for(model)
    items = {}
    for index, _layer in enumerate(adapter.decoder_layers(model)):
        for name in target_names(adapter, config):
            key = (index, name, config.preconditioner, config.damping)
            if key not in svd_cache:
                raise KeyError(f"no cached SVD for layer {index} {name!r} ({config.preconditioner}, damping "
                               f"{config.damping}); run compress_with_moments with this svd_cache first")
            svd = svd_cache[key]
            items[(index, name)] = RankItem(svd.A.shape[1], svd.U.shape[0], svd.S.pow(2))
    return items


def teacher_global_plan(model: nn.Module, config: CompressConfig, moments: dict, svd_cache: dict,
                        calibration: torch.Tensor | None = None, importance: dict | None = None) -> tuple[dict, dict]:
    """Global rank plan for ``compress_with_moments`` from teacher moments and cached rootcov SVDs.

    The spectra are the cached singular values (:func:`weighted_spectra_from_cache`: fill ``svd_cache``
    with one ``compress_with_moments`` call first); ``config.allocation_weighting`` decides the gains.
    ``fisher`` needs ``importance`` ((layer, name) -> f_m, e.g. from a previous call's report) or the
    ``calibration`` blocks to compute it (``gradient_importance.output_gradient_importance``). Returns
    ``(plan, report)`` with the importance under ``report["importance"]`` for reuse at other ratios.
    """
    adapter = adapter_for(model)
    targets = target_names(adapter, config)
    if config.allocation_weighting == "fisher" and importance is None:
        if calibration is None:
            raise ValueError("the 'fisher' allocation weighting needs the calibration token blocks or an importance")
        importance = output_gradient_importance(model, adapter, calibration, targets, config.allocation_gradient_blocks)
    items = weighted_spectra_from_cache(model, config, svd_cache)
    if importance:
        items = {key: dataclasses.replace(item, importance=importance[key]) for key, item in items.items()}
    first_input = moments[0][targets[0]]  # input energy of layer 0: the scale of the "absolute" weighting
    scale = float(torch.diagonal(first_input.second_moment).sum())
    plan, report = plan_from_items(items, config, scale, importance)
    report["importance"] = importance
    return plan, report
