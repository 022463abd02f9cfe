"""The one sequential layer loop of every compression (design.md §3, "Sequential pipeline").

    capture the inputs of decoder layer 0 for the calibration blocks
    plan ranks (uniform, or global: one teacher pass over all layers, pipelines/allocation.py)
    for each decoder layer l (resuming after the last finished layer):
        fit:        the *strategy* collects statistics over the stream, factorizes and replaces
                    the layer's projections (pipelines/local_svd.py, pipelines/latentllm.py)
        propagate:  the stream advances through the compressed layer (statistics="compressed") or
                    is the original layer's output (statistics="teacher")
        checkpoint: the layer's weights, the stream and the reports (pipelines/resume.py)
    finish: exact channel permutation of the MLPs, then the strategy's own last step

Scale-out variants run the same loop: ``offload`` (pipelines/offload.py) keeps the model on the meta
device and reads each layer from its safetensors shards before its fit and frees it after its
checkpoint (out of core); ``parallel`` (pipelines/distributed.py) gives each process a share of the
calibration batches, all-reduces every statistic and spreads the fits of a layer over the processes.

Strategies own no loop: they receive a :class:`LayerContext` per layer, whose ``moments`` and
``run`` are the only ways to pass data through the layer (so the loop knows when the original
layer's outputs, needed by ``statistics="teacher"``, were computed). A strategy may also run on
precomputed statistics (``LayerContext.precomputed``: one teacher pass shared by several runs).
Peak memory ≈ model + one layer's statistics + the calibration activations at one layer boundary.
"""

from __future__ import annotations

import copy
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
from ..linalg.moments import CrossMomentAccumulator, SecondMomentAccumulator
from ..modules.latent_linear import LatentLinear
from .calibration import LayerStream, capture_stream, collect_input_moments, layer_inputs
from .diagnostics import calibration_diagnostics
from .distributed import SINGLE_PROCESS, DataParallel, share_replacement
from .layer_checkpoint import restore_layers, save_layer_progress
from .layer_sources import LayerSource, ResidentLayers, check_layer_weights
from .resume import RunDirectory, fingerprint

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
    """What a strategy sees of one decoder layer, and what it reports back (``entries``, ``extra``)."""

    adapter: ModelAdapter
    model: nn.Module
    layer: nn.Module
    index: int
    plan: Plan
    config: CompressConfig
    targets: list[str]
    stream: LayerStream | None = None  # inputs of this layer per calibration batch
    teacher_stream: LayerStream | None = None  # statistics="teacher_target": the original model's inputs
    teacher_layer: nn.Module | None = None  # statistics="teacher_target": a copy of the original layer
    precomputed: dict | None = None  # projection name -> SecondMomentAccumulator (instead of a stream)
    entries: dict = field(default_factory=dict)  # projection name -> report entry
    extra: dict = field(default_factory=dict)  # per-layer report fields of the strategy
    passes: int = 0  # passes over the calibration stream
    teacher_outputs: LayerStream | None = None  # the original layer's outputs, when recorded
    originals: dict = field(default_factory=dict)  # projection name -> the module before replacement
    parallel: DataParallel = SINGLE_PROCESS  # this process's place in data-parallel calibration

    def __post_init__(self):
        self.originals = {name: self.linear(name) for name in self.adapter.linear_names}

    def linear(self, name: str) -> nn.Module:
        """The projection ``name`` as it is now (original or already replaced)."""
        return self.adapter.get_linear(self.layer, name)

    def where(self, name: str) -> str:
        return f"layer {self.index} input of {name!r} ({self.adapter.linear_path_in_model(self.index, name)})"

    def _record_outputs(self) -> bool:
        """Keep this pass's outputs: the teacher stream, while the layer is still the original."""
        unchanged = all(self.linear(n) is m for n, m in self.originals.items())
        return self.config.statistics == "teacher" and self.teacher_outputs is None and unchanged

    def moments(self, modules: dict[str, nn.Module]) -> dict[str, SecondMomentAccumulator]:
        """One pass: second moments of the inputs of ``modules`` (name -> module), checked finite."""
        if self.stream is None:
            raise ValueError("this strategy needs the calibration stream; precomputed statistics do not suffice")
        self.passes += 1
        if self._record_outputs():
            accumulators, self.teacher_outputs = collect_input_moments(self.layer, self.stream, modules,
                                                                       keep_outputs=True)
        else:
            accumulators = collect_input_moments(self.layer, self.stream, modules)
        for name, accumulator in accumulators.items():
            accumulator.synchronize(self.parallel.all_reduce_sum).check_finite(self.where(name))
        return accumulators

    def synchronize(self, *accumulators) -> None:
        """Moment accumulators (or plain sum tensors) a strategy filled itself, totalled over processes."""
        for accumulator in accumulators:
            if isinstance(accumulator, torch.Tensor):
                self.parallel.all_reduce_sum(accumulator)
            else:
                accumulator.synchronize(self.parallel.all_reduce_sum)

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

    @torch.no_grad()
    def paired_moments(self, modules: dict[str, nn.Module]) -> dict[str, tuple]:
        """One paired pass (``statistics="teacher_target"``): per batch, the original layer on the teacher
        stream and this layer on the stream; for each of ``modules`` (name -> module in this layer):
        ``(C_cc accumulator of x_c, mean of x_t [d], CrossMomentAccumulator E[x_t x_cᵀ])``."""
        self.passes += 1
        stats = {name: (SecondMomentAccumulator(m.in_features, device=_device(self.layer)),
                        CrossMomentAccumulator(m.in_features, m.in_features, device=_device(self.layer)),
                        torch.zeros(m.in_features, dtype=torch.float64, device=_device(self.layer)))
                 for name, m in modules.items()}
        for inputs_t, inputs_c in self.paired_inputs(modules, count_pass=False):
            for name, (moment, cross, sum_t) in stats.items():
                moment.update(inputs_c[name])
                cross.update(inputs_t[name], inputs_c[name])
                sum_t += inputs_t[name].reshape(-1, sum_t.shape[0]).to(torch.float64).sum(0)
        result = {}
        for name, (moment, cross, sum_t) in stats.items():
            moment.check_finite(self.where(name))
            cross.check_finite(self.where(name))
            self.synchronize(moment, cross, sum_t)
            result[name] = (moment, sum_t / cross.count, cross)
        return result

    @torch.no_grad()
    def paired_inputs(self, modules: dict[str, nn.Module], count_pass: bool = True):
        """Per calibration batch ``(inputs_t, inputs_c)``: name -> input of each of ``modules`` (in this layer)
        when the original layer runs on the teacher stream, and when this layer runs on the stream
        (``statistics="teacher_target"``; the two are the same tokens)."""
        if self.teacher_stream is None or self.teacher_layer is None:
            raise ValueError("paired inputs need statistics='teacher_target' (the original model's stream)")
        self.passes += int(count_pass)
        teacher_modules = {name: self.adapter.get_linear(self.teacher_layer, name) for name in modules}
        for h_c, h_t, kwargs in zip(self.stream.hidden, self.teacher_stream.hidden, self.stream.layer_kwargs):
            yield (layer_inputs(self.teacher_layer, teacher_modules, h_t, kwargs),
                   layer_inputs(self.layer, modules, h_c, kwargs))

    def run(self) -> None:
        """One pass of the layer over the stream, for the forward hooks the caller registered."""
        self.passes += 1
        if self._record_outputs():
            self.teacher_outputs = self.stream.advance(self.layer)
        else:
            self.stream.run(self.layer)

    def replace(self, name: str, module: nn.Module, entry: dict) -> None:
        self.entries[name] = entry
        self.adapter.set_linear(self.layer, name, module)


class LayerStrategy(Protocol):
    """A per-layer compression method: ``fit_layer`` replaces the context's projections;
    ``finish`` runs once after the last layer and returns extra report fields."""

    def fit_layer(self, context: LayerContext) -> None: ...

    def finish(self, model: nn.Module, targets: list[str]) -> dict: ...


def _device(layer: nn.Module) -> torch.device:
    return next(layer.parameters()).device


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
    """Fail before any work: non-finite weights (unless ``weights`` is False: an out-of-core loop checks each
    layer when it is read), calibration of the wrong shape or too few tokens."""
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
    stream, teacher_stream, diagnostics = None, None, None
    if calibration is not None:
        t0 = time.perf_counter()
        with source.capturing():
            stream = capture_stream(model, adapter, parallel.shard(calibration, config.batch_size), config.batch_size)
        diagnostics = calibration_diagnostics(calibration, stream)
        if config.statistics == "teacher_target":  # one more activation buffer: the original model's stream
            teacher_stream = stream.clone()
        timings["capture"] = time.perf_counter() - t0
    rss_after_capture = current_rss_mb()
    t0 = time.perf_counter()
    plan, plan_report = planner(stream)
    timings["allocation"] = time.perf_counter() - t0
    calibrated = stream is not None
    if precomputed is not None:
        stream = None  # the fits read precomputed statistics: nothing flows through the layers any more

    run_dir, first, reports = None, 0, []
    if checkpoint_dir is not None and calibrated:
        if parallel.active:  # each process resumes its own stream
            checkpoint_dir = f"{checkpoint_dir}/rank{parallel.rank}"
        run_dir = RunDirectory(checkpoint_dir, fingerprint(config.to_dict(), calibration,
                                                           str(getattr(model, "name_or_path", "")),
                                                           model.config.to_dict()))
        first, reports, stream, teacher_stream = restore_layers(run_dir, model, adapter, stream, teacher_stream, config,
                                                          load_weights=source.weights_resident)
        if first:
            log.info("resuming compression after layer %d from %s", first - 1, run_dir.path)

    bar = tqdm(range(first, len(layers)), desc=f"compress {config.method} {config.ratio:g}", disable=not progress,
               initial=first, total=len(layers))
    for index in bar:
        layer_start = time.perf_counter()
        source.onload(index, layers[index])
        source.check_onloaded(adapter, index, layers[index], targets)
        teacher_layer = copy.deepcopy(layers[index]) if teacher_stream is not None else None
        context = LayerContext(adapter, model, layers[index], index, plan, config, targets, stream=stream,
                               teacher_stream=teacher_stream, teacher_layer=teacher_layer,
                               precomputed=None if precomputed is None else precomputed[index], parallel=parallel)
        strategy.fit_layer(context)
        if forms is not None:
            forms.apply(context)
        parallel.broadcast_module(layers[index])  # every process continues with rank 0's exact layer
        timings["fit"] += time.perf_counter() - layer_start
        t0 = time.perf_counter()
        if stream is not None:
            if config.statistics == "teacher":
                if context.teacher_outputs is None:
                    raise RuntimeError(f"layer {index}: the strategy replaced projections before any pass over the "
                                       f"stream, so the original layer's outputs were never computed")
                stream = context.teacher_outputs
            else:
                stream = stream.advance(layers[index])
            if teacher_stream is not None:
                teacher_stream = teacher_stream.advance(teacher_layer)
        del teacher_layer  # the copy of the original layer: one layer of memory at a time
        timings["propagation"] += time.perf_counter() - t0
        # RSS after each layer: with the process peak it locates where compression holds its memory
        reports.append({"layer": index, "seconds": time.perf_counter() - layer_start, "matrices": context.entries,
                        "passes": context.passes, "rss_mb": current_rss_mb(), **context.extra})
        mean_error = sum(e["proxy_error"] for e in context.entries.values()) / max(1, len(context.entries))
        log.info("layer %d: mean proxy error %.4f, %d passes, %.1fs", index, mean_error, context.passes,
                 reports[-1]["seconds"])
        context = None  # it holds the stream entering this layer and the original projections: free them now
        bar.set_postfix(proxy=f"{mean_error:.3f}")
        reports[-1].update(source.lead_layer_pivots(model, index))  # before the layer is saved
        if run_dir is not None:
            save_layer_progress(run_dir, index, layers[index], stream, teacher_stream, reports)
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
