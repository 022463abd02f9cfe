"""Sequential layer-wise compression (design.md §3, "Sequential pipeline").

For every decoder layer l, in order:
 1. run layer l (still original) over the calibration stream with hooks, accumulating the second
    moment C = E[x xᵀ] (float64) of the input of every projection group (q/k/v share one input);
 2. replace each target projection by a ``LatentLinear`` fitted with the activation-aware SVD of
    the configured preconditioner at its planned rank (bias-compensated when the layer has a bias);
 3. advance the stream through the compressed layer (``statistics="compressed"``) — or through the
    original layer (``"teacher"``: statistics of the uncompressed model);
 4. checkpoint the layer and the stream when a checkpoint directory is given (resumable).

Peak memory ≈ model + one layer's statistics + the calibration activations at one layer boundary.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from ..adapters import adapter_for
from ..adapters.mlp_permutation import lead_mlp_pivots
from ..config import CompressConfig
from ..eval.resources import current_rss_mb, peak_rss_mb
from ..linalg.ranks import rank_for_keep_fraction
from ..linalg.svd import bias_compensation, build_preconditioner, proxy_error, weighted_svd
from ..modules.latent_linear import LatentLinear
from .calibration import LayerStream, capture_stream, collect_input_moments

__all__ = ["compress_model", "compress_layer", "compress_with_moments", "plan_ranks", "CalibrationError",
           "collect_teacher_moments"]

log = logging.getLogger(__name__)


class CalibrationError(ValueError):
    """Calibration data cannot support the requested compression."""


def plan_ranks(model: nn.Module, config: CompressConfig) -> dict[tuple[int, str], int]:
    """Uniform allocation: every target matrix keeps (1 − ratio) of its parameters.

    Returns (layer index, projection name) -> rank: the largest rank whose stored factors
    (r(d+d') − r² with a junction, r(d+d') without) fit in (1 − ratio)·d·d'.
    """
    adapter = adapter_for(model)
    plan = {}
    for index, layer in enumerate(adapter.decoder_layers(model)):
        for name in _targets(adapter, config):
            linear = adapter.get_linear(layer, name)
            try:
                plan[(index, name)] = rank_for_keep_fraction(linear.in_features, linear.out_features,
                                                             1.0 - config.ratio, junction=config.junction)
            except ValueError as error:
                raise ValueError(f"layer {index} {name} ({linear.out_features}x{linear.in_features}): {error}") from None
    return plan


def _targets(adapter, config: CompressConfig) -> list[str]:
    names = list(adapter.linear_names)
    if not config.targets:
        return names
    unknown = [t for t in config.targets if t not in names]
    if unknown:
        raise ValueError(f"unknown targets {unknown} for {adapter.family} models; their projections are {names}")
    return [n for n in names if n in config.targets]


def _check_weights_finite(model: nn.Module, adapter, targets: list[str]) -> None:
    for index, layer in enumerate(adapter.decoder_layers(model)):
        for name in targets:
            weight = adapter.get_linear(layer, name).weight
            if not torch.isfinite(weight).all():
                raise ValueError(f"non-finite values (NaN/Inf) in the weights of layer {index} projection {name!r} "
                                 f"({adapter.linear_path_in_model(index, name)})")


def _fingerprint(model: nn.Module, config: CompressConfig, calibration: torch.Tensor) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps(config.to_dict(), sort_keys=True).encode())
    digest.update(calibration.cpu().numpy().tobytes())
    digest.update(str(getattr(model, "name_or_path", "")).encode())
    digest.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


@torch.no_grad()
def compress_model(model: nn.Module, config: CompressConfig, calibration: torch.Tensor, progress: bool = True,
                   checkpoint_dir=None) -> tuple[nn.Module, dict]:
    """Compress ``model`` in place; returns ``(model, report)`` (see module docstring).

    ``method="latentllm"`` and every ``allocation="global"`` run go through pipelines/latentllm.py
    (the global plan needs a pass over all layers first); a local method with a global allocation
    runs there with all joint decompositions off, i.e. local factors with globally allocated ranks.
    """
    if config.method == "latentllm" or config.allocation == "global":
        from .latentllm import compress_latentllm

        if config.method != "latentllm":
            config = dataclasses.replace(config, joint_qk=False, joint_vo=False, joint_mlp=False,
                                         latent_attention=False)
        return compress_latentllm(model, config, calibration, progress=progress, checkpoint_dir=checkpoint_dir)
    start = time.perf_counter()
    adapter = adapter_for(model)
    layers = adapter.decoder_layers(model)
    targets = _targets(adapter, config)
    _check_weights_finite(model, adapter, targets)
    plan = plan_ranks(model, config)
    if calibration.ndim != 2:
        raise CalibrationError(f"calibration must be token blocks [n_blocks, seq_len], got shape {tuple(calibration.shape)}")
    widest = max(adapter.get_linear(layers[0], n).in_features for n in targets)
    if calibration.numel() < widest:
        raise CalibrationError(f"calibration has {calibration.numel()} tokens, fewer than the widest projection input "
                               f"({widest}); its statistics would be singular — give at least {widest} tokens "
                               f"(thousands more is better)")
    model.eval()
    timings = {"statistics": 0.0, "factorization": 0.0, "propagation": 0.0, "capture": 0.0}
    checkpoint = _Checkpoint(checkpoint_dir, _fingerprint(model, config, calibration)) if checkpoint_dir else None

    t0 = time.perf_counter()
    stream = capture_stream(model, adapter, calibration, config.batch_size)
    timings["capture"] += time.perf_counter() - t0
    rss_after_capture = current_rss_mb()
    first_layer = 0
    layer_reports: list[dict] = []
    if checkpoint is not None:
        first_layer, layer_reports = checkpoint.restore(model, adapter, stream, plan, config)
        if first_layer:
            log.info("resuming compression after layer %d from %s", first_layer - 1, checkpoint.path)

    bar = tqdm(range(first_layer, len(layers)), desc=f"compress {config.method} {config.ratio:g}",
               disable=not progress, initial=first_layer, total=len(layers))
    for index in bar:
        layer = layers[index]
        layer_start = time.perf_counter()
        leaders = {group[0]: adapter.get_linear(layer, group[0]) for group in adapter.linear_groups
                   if any(name in targets for name in group)}
        leader_of = {name: group[0] for group in adapter.linear_groups for name in group}
        t0 = time.perf_counter()
        teacher_mode = config.statistics == "teacher"
        if teacher_mode:  # the stream stays the original model's: it advances through the original layer
            moments, next_stream = collect_input_moments(layer, stream, leaders, keep_outputs=True)
        else:
            moments = collect_input_moments(layer, stream, leaders)
        timings["statistics"] += time.perf_counter() - t0

        t0 = time.perf_counter()
        entries = compress_layer(adapter, layer, index, targets, plan, config,
                                 {name: moments[leader_of[name]] for name in targets})
        timings["factorization"] += time.perf_counter() - t0

        t0 = time.perf_counter()
        stream = next_stream if teacher_mode else stream.advance(layer)
        timings["propagation"] += time.perf_counter() - t0
        # RSS after each layer: with the process peak it locates where compression holds its memory
        layer_reports.append({"layer": index, "seconds": time.perf_counter() - layer_start, "matrices": entries,
                              "rss_mb": current_rss_mb()})
        mean_error = sum(e["proxy_error"] for e in entries.values()) / max(1, len(entries))
        log.info("layer %d: mean proxy error %.4f, %.1fs", index, mean_error, time.perf_counter() - layer_start)
        bar.set_postfix(proxy=f"{mean_error:.3f}")
        if checkpoint is not None:
            checkpoint.save_layer(index, layer, stream, layer_reports)
    bar.close()
    mlp_layers_sliced = lead_mlp_pivots(model)  # exact; lets down projections slice instead of gather
    timings["total"] = time.perf_counter() - start
    report = _summary(model, adapter, config, plan, layer_reports, timings)
    report["rss_after_capture_mb"] = rss_after_capture
    report["mlp_layers_with_leading_pivots"] = mlp_layers_sliced
    if checkpoint is not None:
        checkpoint.finish()
    return model, report


def compress_layer(adapter, layer: nn.Module, index: int, targets: list[str], plan: dict, config: CompressConfig,
                   moments: dict, svd_cache: dict | None = None) -> dict:
    """Replace each target projection of ``layer`` by a ``LatentLinear`` fitted on its input moments.

    ``moments``: projection name -> ``SecondMomentAccumulator`` of its input. Layers with a bias are
    fitted on centered statistics with bias compensation b̂ = b + (W − BA)μ. Projections sharing an
    input share one preconditioner (one eigendecomposition). ``svd_cache`` (optional dict) keeps the
    full weighted SVD of each matrix, so compressing the same model again at another ratio only
    truncates. Returns per-matrix info.
    """
    entries = {}
    preconditioners: dict = {}
    for name in targets:
        linear = adapter.get_linear(layer, name)
        accumulator = moments[name]
        where = f"layer {index} input of {name!r} ({adapter.linear_path_in_model(index, name)})"
        accumulator.check_finite(where)
        rank = plan[(index, name)]
        has_bias = linear.bias is not None
        mean = accumulator.mean if has_bias else None
        # centered statistics with a bias (the bias absorbs the mean), raw second moment without
        moment = accumulator.covariance() if has_bias else accumulator.second_moment
        key = (index, name, config.preconditioner, config.damping)
        svd = svd_cache.get(key) if svd_cache is not None else None
        if svd is None:
            shared = preconditioners.get(id(accumulator))
            if shared is None:
                shared = build_preconditioner(moment, linear.in_features, config.preconditioner, config.damping,
                                              where, linear.weight.device)
                preconditioners[id(accumulator)] = shared
            svd = weighted_svd(linear.weight, moment, shared, name=where)
            if svd_cache is not None:
                svd_cache[key] = svd
        B, A = svd.factors(rank)
        bias = linear.bias.detach() if has_bias else None
        if mean is not None:
            bias = bias_compensation(linear.weight, B, A, bias, mean)
        replacement = LatentLinear.from_factors(B, A, bias=bias, junction=config.junction,
                                                dtype=linear.weight.dtype, device=linear.weight.device)
        error = proxy_error(linear.weight, B, A, moment)
        entries[name] = {"rank": rank, "in": linear.in_features, "out": linear.out_features,
                         "params_before": linear.weight.numel(), "params_after": replacement.num_weight_params(),
                         "proxy_error": error}
        adapter.set_linear(layer, name, replacement)
    return entries


def _summary(model, adapter, config, plan, layer_reports, timings) -> dict:
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


@torch.no_grad()
def collect_teacher_moments(model: nn.Module, calibration: torch.Tensor, batch_size: int = 8,
                            progress: bool = True) -> dict[int, dict[str, object]]:
    """Input second moments of every projection of the *original* model, all layers, one pass.

    Returns layer index -> projection name -> ``SecondMomentAccumulator`` (projections sharing an
    input share one accumulator). Lets several compressions (methods × ratios) of one model reuse a
    single statistics pass (``statistics="teacher"``). Memory: one d×d float64 matrix per distinct
    input per layer.
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
    e.g. a global one from :func:`weighted_spectra_from_cache` + ``allocation.plan_from_items``.
    """
    start = time.perf_counter()
    adapter = adapter_for(model)
    targets = _targets(adapter, config)
    _check_weights_finite(model, adapter, targets)
    plan = plan_ranks(model, config) if plan is None else plan
    reports = []
    for index, layer in enumerate(adapter.decoder_layers(model)):
        t0 = time.perf_counter()
        entries = compress_layer(adapter, layer, index, targets, plan, config, moments[index], svd_cache)
        reports.append({"layer": index, "seconds": time.perf_counter() - t0, "matrices": entries})
    lead_mlp_pivots(model)
    timings = {"factorization": time.perf_counter() - start, "total": time.perf_counter() - start}
    return model, _summary(model, adapter, config, plan, reports, timings)


def weighted_spectra_from_cache(model: nn.Module, config: CompressConfig, svd_cache: dict) -> dict:
    """(layer, name) -> ``allocation.RankItem`` from the singular values S of cached weighted SVDs.

    For rootcov, S² is the exact output-error spectrum (allocation.py); ``svd_cache`` must hold every
    target matrix (fill it with one ``compress_with_moments`` call at any ratio).
    """
    from .allocation import RankItem

    adapter = adapter_for(model)
    items = {}
    for index, layer in enumerate(adapter.decoder_layers(model)):
        for name in _targets(adapter, config):
            key = (index, name, config.preconditioner, config.damping)
            if key not in svd_cache:
                raise KeyError(f"no cached SVD for layer {index} {name!r} ({config.preconditioner}, damping "
                               f"{config.damping}); run compress_with_moments with this svd_cache first")
            svd = svd_cache[key]
            items[(index, name)] = RankItem(svd.Vh.shape[1], svd.U.shape[0], svd.S.pow(2))
    return items


def teacher_global_plan(model: nn.Module, config: CompressConfig, moments: dict, svd_cache: dict,
                        calibration: torch.Tensor | None = None, importance: dict | None = None) -> tuple[dict, dict]:
    """Global rank plan for ``compress_with_moments`` from teacher moments and cached rootcov SVDs.

    The spectra are the cached singular values (:func:`weighted_spectra_from_cache`: fill ``svd_cache``
    with one ``compress_with_moments`` call first); ``config.allocation_weighting`` decides the gains.
    ``fisher`` needs ``importance`` ((layer, name) -> f_m, e.g. from a previous call's report) or the
    ``calibration`` blocks to compute it (``allocation.output_gradient_importance``). Returns
    ``(plan, report)`` with the importance under ``report["importance"]`` for reuse at other ratios.
    """
    from .allocation import output_gradient_importance, plan_from_items

    adapter = adapter_for(model)
    targets = _targets(adapter, config)
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


class _Checkpoint:
    """Per-layer resumability: finished layers' weights, the stream at the last boundary, progress."""

    def __init__(self, path, fingerprint: str):
        self.path = Path(path)
        self.fingerprint = fingerprint
        self.path.mkdir(parents=True, exist_ok=True)

    def _progress_file(self) -> Path:
        return self.path / "progress.json"

    def restore(self, model, adapter, stream: LayerStream, plan, config) -> tuple[int, list]:
        if not self._progress_file().exists():
            return 0, []
        progress = json.loads(self._progress_file().read_text())
        if progress.get("fingerprint") != self.fingerprint:
            log.warning("checkpoint %s belongs to a different run (settings or calibration changed); starting over",
                        self.path)
            return 0, []
        done = progress["layers_done"]
        layers = adapter.decoder_layers(model)
        for index in range(done):
            layer = layers[index]
            for entry in progress["reports"][index]["matrices"].items():
                name, info = entry
                linear = adapter.get_linear(layer, name)
                adapter.set_linear(layer, name, LatentLinear(info["in"], info["out"], info["rank"], junction=config.junction,
                                                             bias=linear.bias is not None, dtype=linear.weight.dtype,
                                                             device=linear.weight.device))
            layer.load_state_dict(load_file(self.path / f"layer_{index}.safetensors"))
        saved = load_file(self.path / "stream.safetensors")
        stream.hidden = [saved[f"batch_{i}"].to(stream.hidden[i]) for i in range(len(stream.hidden))]
        return done, progress["reports"]

    def save_layer(self, index: int, layer: nn.Module, stream: LayerStream, reports: list) -> None:
        state = {k: v.contiguous() for k, v in layer.state_dict().items()}
        _atomic_save(state, self.path / f"layer_{index}.safetensors")
        _atomic_save({f"batch_{i}": h.contiguous() for i, h in enumerate(stream.hidden)}, self.path / "stream.safetensors")
        tmp = self._progress_file().with_suffix(".tmp")
        tmp.write_text(json.dumps({"fingerprint": self.fingerprint, "layers_done": index + 1, "reports": reports}))
        tmp.replace(self._progress_file())

    def finish(self) -> None:
        import shutil

        shutil.rmtree(self.path, ignore_errors=True)


def _atomic_save(tensors: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)
