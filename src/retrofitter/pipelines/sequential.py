"""The one sequential layer loop of every compression (design.md §3, "Sequential pipeline").

    capture the inputs of decoder layer 0 for the calibration blocks
    plan ranks (uniform, or global: one teacher pass over all layers, pipelines/allocation.py)
    for each decoder layer l (resuming after the last finished layer):
        onload:     the layer source makes layer l's weights present
        fit:        the *strategy* passes over the stream through the layer's statistics, factorizes and
                    replaces the layer's projections (pipelines/local_svd.py, pipelines/latentllm.py)
        propagate:  the statistics source moves its stream(s) to layer l + 1
        checkpoint: the layer's weights, the stream(s) and the reports (pipelines/layer_checkpoint.py),
                    then the layer source releases the layer
    finish: exact channel permutation of the MLPs, then the strategy's own last step

The loop has no variants of its own; it is handed two kinds of objects (llm-compressor's shape):

* where the layers come from, a ``LayerSource`` (pipelines/layer_sources.py): ``ResidentLayers`` for a
  model in memory, ``LayerOffload`` (pipelines/offload.py, the ``offload`` argument) for a model on the
  meta device whose layers are read from the safetensors shards one at a time (out of core);
* where the statistics come from, a ``StatisticsSource`` (pipelines/statistics_sources.py, one per
  ``config.statistics``: the compressed model's stream, the original model's, or both for teacher targets;
  or statistics precomputed by one teacher pass shared by several runs).

``parallel`` (pipelines/distributed.py) gives each process a share of the calibration batches; the layer's
statistics all-reduce every accumulator and ``LayerContext.fit_spread`` spreads the fits over the processes.

Strategies own no loop: they receive a :class:`LayerContext` per layer, whose ``statistics``
(pipelines/layer_statistics.py) are the only way to pass data through the layer, and report back through
``replace`` (and ``entries``/``extra``).
Peak memory ≈ model + one layer's statistics + the calibration activations at one layer boundary.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from ..adapters import ModelAdapter, adapter_for
from ..config import CompressConfig
from ..eval.resources import current_rss_mb, peak_rss_mb
from ..modules.latent_linear import LatentLinear
from .calibration import LayerStream, capture_stream
from .diagnostics import calibration_diagnostics
from .distributed import SINGLE_PROCESS, DataParallel, share_replacement
from .layer_checkpoint import restore_layers, save_layer_progress
from .layer_sources import LayerSource, ResidentLayers, check_layer_weights
from .layer_statistics import StreamStatistics
from .resume import RunDirectory, layer_run_fingerprint
from .statistics_sources import statistics_source

__all__ = ["CalibrationError", "LayerContext", "LayerStrategy", "Planner", "run_sequential", "target_names",
           "check_compressible", "summarize"]

log = logging.getLogger(__name__)

# (layer index, projection name) -> rank, and a report of how the plan was made
Plan = dict[tuple[int, str], int]
Planner = Callable[[LayerStream | None], tuple[Plan, dict]]


class CalibrationError(ValueError):
    """Calibration data cannot support the requested compression."""


@dataclass
class LayerContext:
    """What a strategy sees of one decoder layer, and what it reports back (``replace``, ``entries``, ``extra``)."""

    adapter: ModelAdapter
    model: nn.Module
    layer: nn.Module
    index: int
    plan: Plan
    config: CompressConfig
    targets: list[str]
    statistics: StreamStatistics  # every pass over the stream (pipelines/layer_statistics.py)
    parallel: DataParallel = SINGLE_PROCESS  # this process's place in data-parallel calibration
    entries: dict = field(default_factory=dict)  # projection name -> report entry
    extra: dict = field(default_factory=dict)  # per-layer report fields of the strategy

    def linear(self, name: str) -> nn.Module:
        """The projection ``name`` as it is now (original or already replaced)."""
        return self.adapter.get_linear(self.layer, name)

    def where(self, name: str) -> str:
        return self.statistics.where(name)

    def fit_spread(self, fits: dict[str, Callable[[], None]]) -> None:
        """Run ``fits`` (projection name -> a fit that calls :meth:`replace` for that name) spread over the
        processes: each runs the fits it owns (round-robin, shifted by the layer index), then every
        replacement is broadcast from its owner. One process: all fits, in order."""
        if not self.parallel.active:
            for fit in fits.values():
                fit()
            return
        owners = {name: self.parallel.owner(self.index + i) for i, name in enumerate(fits)}
        for name, fit in fits.items():
            if owners[name] == self.parallel.rank:
                fit()
        for name, owner in owners.items():
            original = self.linear(name)
            mine = owner == self.parallel.rank
            module, entry = share_replacement(
                self.parallel, owner, original if mine else None, self.entries.get(name) if mine else None,
                lambda entry, original=original: _empty_latent(entry, original, self.config.junction))
            if not mine:
                self.replace(name, module, entry)

    def replace(self, name: str, module: nn.Module, entry: dict) -> None:
        self.entries[name] = entry
        self.adapter.set_linear(self.layer, name, module)


class LayerStrategy(Protocol):
    """A per-layer compression method: ``fit_layer`` replaces the context's projections;
    ``finish`` runs once after the last layer and returns extra report fields."""

    def fit_layer(self, context: LayerContext) -> None: ...

    def finish(self, model: nn.Module, targets: list[str]) -> dict: ...


def _empty_latent(entry: dict, original: nn.Module, junction: bool) -> LatentLinear:
    """An empty LatentLinear of a report entry's shape (a receiver of :func:`share_replacement`)."""
    reference = original.weight
    return LatentLinear(entry["in"], entry["out"], entry["rank"], junction=junction, bias=original.bias is not None,
                        dtype=reference.dtype, device=reference.device)


def target_names(adapter: ModelAdapter, config: CompressConfig) -> list[str]:
    """The adapter's projection names selected by ``config.targets`` (all when empty), in layer order."""
    names = list(adapter.linear_names)
    unknown = [t for t in config.targets if t not in names]
    if unknown:
        raise ValueError(f"unknown targets {unknown} for {adapter.family} models; their projections are {names}")
    return [n for n in names if not config.targets or n in config.targets]


def check_compressible(model: nn.Module, adapter: ModelAdapter, targets: list[str],
                       calibration: torch.Tensor | None, weights: bool = True) -> None:
    """Fail before any work: non-finite weights (with ``weights``: the layer source's ``weights_resident``; a
    source that reads the layers later checks each one when it is read), calibration of the wrong shape or too
    few tokens."""
    layers = adapter.decoder_layers(model)
    for index, layer in enumerate(layers if weights else []):
        check_layer_weights(adapter, layer, index, targets)
    if calibration is None:
        return
    if calibration.ndim != 2:
        raise CalibrationError(f"calibration must be token blocks [n_blocks, seq_len], got shape {tuple(calibration.shape)}")
    widest = max(adapter.get_linear(layers[0], n).in_features for n in targets)
    if calibration.numel() < widest:
        raise CalibrationError(f"calibration has {calibration.numel()} tokens, fewer than the widest projection input "
                               f"({widest}); its statistics would be singular — give at least {widest} tokens "
                               f"(thousands more is better)")


@torch.no_grad()
def run_sequential(model: nn.Module, config: CompressConfig, strategy: LayerStrategy, planner: Planner, *,
                   calibration: torch.Tensor | None = None, precomputed: dict | None = None, progress: bool = True,
                   checkpoint_dir=None, remove_checkpoint: bool = True, offload: LayerSource | None = None,
                   parallel: DataParallel = SINGLE_PROCESS, forms=None) -> tuple[nn.Module, dict]:
    """Compress ``model`` in place (module docstring); returns ``(model, report)``.

    Give ``calibration`` token blocks [n_blocks, seq_len] (the stream is captured and propagated),
    ``precomputed`` statistics (layer index -> projection name -> accumulator), or both: then the stream
    serves the planner only (which may fill ``precomputed``, pipelines/moment_spill.py) and is dropped.
    ``checkpoint_dir`` makes the run resumable; it is removed when the run completes unless
    ``remove_checkpoint`` is False (a caller that saves the model removes it once the save is in place).
    ``offload``: the layer source of a ``model`` on the meta device (pipelines/offload.py ``LayerOffload``:
    each layer is read before its fit and freed after it; needs ``checkpoint_dir``, where the finished
    layers' weights stay, ``layer_<l>.safetensors``, for the caller to write out); None: the model is in
    memory (``ResidentLayers``). ``parallel``: this process's share of data-parallel calibration (every process
    passes the same ``calibration``; each captures its own batches). ``forms`` (pipelines/form_choice.py):
    re-express each fitted layer's matrices in their chosen factor forms, right after the fit.
    """
    start = time.perf_counter()
    source = ResidentLayers() if offload is None else offload
    adapter = adapter_for(model)
    layers = adapter.decoder_layers(model)
    targets = target_names(adapter, config)
    check_compressible(model, adapter, targets, calibration, weights=source.weights_resident)
    source.check_run(calibration, checkpoint_dir)
    model.eval()
    timings = {"capture": 0.0, "allocation": 0.0, "fit": 0.0, "propagation": 0.0}
    t0 = time.perf_counter()
    stream, diagnostics = None, None
    if calibration is not None:
        with source.capturing():
            stream = capture_stream(model, adapter, parallel.shard(calibration, config.batch_size), config.batch_size)
        diagnostics = calibration_diagnostics(calibration, stream)
    statistics = statistics_source(config.statistics, stream, precomputed, parallel)
    timings["capture"] = time.perf_counter() - t0
    rss_after_capture = current_rss_mb()
    t0 = time.perf_counter()
    plan, plan_report = planner(stream)
    timings["allocation"] = time.perf_counter() - t0
    del stream  # from here on the statistics source holds the stream(s), if any flow

    run_dir, first, reports = None, 0, []
    if checkpoint_dir is not None and calibration is not None:
        run_dir = _run_directory(checkpoint_dir, model, config, calibration, parallel)
        first, reports, streams = restore_layers(run_dir, model, adapter, config, statistics.streams(),
                                                 load_weights=source.weights_resident)
        statistics.restore(streams)
        if first:
            log.info("resuming compression after layer %d from %s", first - 1, run_dir.path)

    bar = tqdm(range(first, len(layers)), desc=f"compress {config.method} {config.ratio:g}", disable=not progress,
               initial=first, total=len(layers))
    for index in bar:
        layer_start = time.perf_counter()
        source.onload(index, layers[index])
        source.check_onloaded(adapter, index, layers[index], targets)
        context = LayerContext(adapter, model, layers[index], index, plan, config, targets,
                               statistics.for_layer(adapter, layers[index], index), parallel)
        strategy.fit_layer(context)
        if forms is not None:
            forms.apply(context)
        parallel.broadcast_module(layers[index])  # every process continues with rank 0's exact layer
        timings["fit"] += time.perf_counter() - layer_start
        t0 = time.perf_counter()
        statistics.advance(context.statistics)
        timings["propagation"] += time.perf_counter() - t0
        # RSS after each layer: with the process peak it locates where compression holds its memory
        passes = context.statistics.passes
        reports.append({"layer": index, "seconds": time.perf_counter() - layer_start, "matrices": context.entries,
                        "passes": passes, "rss_mb": current_rss_mb(), **context.extra})
        mean_error = sum(e["proxy_error"] for e in context.entries.values()) / max(1, len(context.entries))
        log.info("layer %d: mean proxy error %.4f, %d passes, %.1fs", index, mean_error, passes,
                 reports[-1]["seconds"])
        # it holds the stream entering this layer, the original projections (and the teacher's copy): free them now
        context = None
        bar.set_postfix(proxy=f"{mean_error:.3f}")
        reports[-1].update(source.lead_layer_pivots(model, index))  # before the layer is saved
        if run_dir is not None:
            save_layer_progress(run_dir, index, layers[index], statistics.streams(), reports)
        source.release(index, layers[index])
    bar.close()
    pivoted = source.lead_remaining_pivots(model, reports)
    finished = strategy.finish(model, targets)
    timings["total"] = time.perf_counter() - start
    report = summarize(config, reports, timings)
    report.update(checkpoint_dir=None if run_dir is None else str(run_dir.path))
    report.update(calibration=diagnostics, rss_after_capture_mb=rss_after_capture, allocation=plan_report,
                  mlp_layers_with_leading_pivots=pivoted, ranks={f"{i}.{n}": r for (i, n), r in sorted(plan.items())}, **finished)
    if run_dir is not None and remove_checkpoint:
        run_dir.remove()
    return model, report


def _run_directory(checkpoint_dir, model: nn.Module, config: CompressConfig, calibration: torch.Tensor,
                   parallel: DataParallel) -> RunDirectory:
    """The resumable run's work directory, fingerprinted by the run's inputs (each process its own)."""
    if parallel.active:  # each process resumes its own stream
        checkpoint_dir = f"{checkpoint_dir}/rank{parallel.rank}"
    return RunDirectory(checkpoint_dir, layer_run_fingerprint(config, calibration, model))


def summarize(config: CompressConfig, layer_reports: list[dict], timings: dict) -> dict:
    """The report fields every compression has (parameters of the targets before/after, per layer, timings)."""
    before = sum(e["params_before"] for r in layer_reports for e in r["matrices"].values())
    after = sum(e["params_after"] for r in layer_reports for e in r["matrices"].values())
    return {
        "method": config.method,
        "ratio": config.ratio,
        "config": config.to_dict(),
        "targets_params_before": before,
        "targets_params_after": after,
        "targets_reduction": 1.0 - after / before if before else 0.0,
        "layers": layer_reports,
        "timings_s": timings,
        "peak_rss_mb": peak_rss_mb(),
    }
