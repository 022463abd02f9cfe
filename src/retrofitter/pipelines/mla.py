"""``retrofitter mla``: convert every attention layer to Multi-head Latent Attention (closed form, then optionally
an attention transfer per layer: pipelines/mla_transfer.py).

One pass over the layers (llm-compressor's shape: the loop owns the layers, the math is linalg/mla.py):
the calibration stream enters layer l, the second moment of the attention input is collected, the layer's
q/k/v become MLA factors (shared rotary slots + one whitened joint k/v latent), the attention module is
swapped for ``MLAAttention`` (absorbed execution), with ``transfer_epochs`` > 0 trained to reproduce the original
model's attention output (``transfer_target``; the original model's stream then advances alongside), its square
up-projections folded into q/o (``fold_up_projections``), and the stream leaves through the *converted* layer, so
layer l + 1 is fitted on what it will see. With a ``checkpoint_dir`` the loop resumes after the last finished layer.
Budget per layer: ``kv_ratio`` · 2·g·dh cached numbers per token, ``rope_fraction`` of them in the shared rotary key
(``linalg.mla.mla_budget``).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from ..adapters.mla_attention import (attention_kwargs_at, attention_probabilities, attention_score_settings,
                                      check_mla_supported, mla_attention_from_factors, model_inv_freq,
                                      rebuild_mla_attention)
from ..adapters.registry import adapter_for
from ..config import JsonRoundTrip, option
from ..config.fields import AUTOCAST_CHOICES
from ..data.blocks import with_repeated_spans
from ..eval.resources import release_free_heap_memory
from ..linalg.mla import SLOT_SELECTIONS, mla_budget, mla_factors, progression_totals, slot_scores
from ..linalg.mla_rotation_fit import RotationFitStatistics
from ..modules.latent_linear import LatentLinear
from .calibration import LayerStream, capture_stream, collect_input_moments, layer_inputs
from .layer_checkpoint import restore_streams, save_layer_progress
from .mla_transfer import (TRANSFER_EXECUTIONS, TRANSFER_TARGETS, at_position, at_positions, attention_batches,
                           carries_original_stream, iter_attention_batches, residual_norm_weights,
                           skipped_position_ids, teacher_targets, transfer_attention)
from .mlp_transfer import layer_batches, transfer_mlp
from .resume import RunDirectory, layer_run_fingerprint
from .training import resolve_autocast_dtype

UNROTATED_FITS = ("attention", "uniform", "none")
TRANSFER_WEIGHTINGS = ("uniform", "residual-norm")  # MLAConfig.transfer_weighting

__all__ = ["TRANSFER_WEIGHTINGS", "UNROTATED_FITS", "MLA_PRESETS", "MLAConfig", "convert_to_mla",
           "rotation_fit_statistics", "shared_progression_step"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MLAConfig(JsonRoundTrip):
    """Settings of the MLA conversion (module docstring); checked when built."""

    kv_ratio: float = option(0.25, "cached numbers per token and layer, as a fraction of the original's 2·n_kv·d_h")
    rope_fraction: float = option(1 / 3, "share of that budget in the shared rotary key (the rest: the latent)")
    rope_selection: str = option("progression", "which rotary slots keep RoPE: progression (the frequencies 0, s, "
                                 "2s, ... with the step and components of the highest score: one rope base, so it "
                                 "exports to DeepSeek-V3), score (size x error of dropping the rotation, any "
                                 "slots), energy (size only), frequency (highest first)", choices=SLOT_SELECTIONS)
    kv_metric: str = option("diagonal", "how the joint k/v latent weighs its errors: diagonal (key rows by query "
                            "energy) or output (keys through the query covariance, values through o_proj)",
                            choices=("diagonal", "output"))
    rope_step: int = option(0, "progression step s (frequencies 0, s, 2s, ...), one for every layer; 0: the step "
                            "of the highest score summed over the layers, on the original model's statistics")
    unrotated_fit: str = option("attention", "the query side of the slots that lose RoPE: attention (a 2x2 map "
                                "per head and slot, least squares to the original scores under the original "
                                "attention), uniform (the same map fitted with every earlier key weighted alike: "
                                "the term's mean over distances, for far keys) or none (the query as it is: exact "
                                "at distance 0)",
                                choices=UNROTATED_FITS)
    fit_blocks: int = option(8, "calibration blocks whose attention the unrotated fit reads (the first ones)")
    fit_queries: int = option(128, "queries per block in the unrotated fit, evenly spaced, the last included")
    transfer_epochs: int = option(0, "epochs of attention transfer after each layer's closed-form fit: the MLA "
                                  "module learns the original model's attention output on the calibration blocks "
                                  "(--transfer-target; 0: training-free)")
    transfer_lr: float = option(3e-3, "peak Adam learning rate of the attention transfer (cosine decay to 0)")
    transfer_batch: int = option(1, "calibration blocks per attention-transfer step: one block per step takes 4x "
                                 "the Adam steps of 4 (762 s against 704 s) and gives a better model (SmolLM2-135M "
                                 "at KV 0.25x, 128 blocks: 36.74 against 43.16 wiki-eval perplexity; "
                                 "docs/results.md 13d)")
    transfer_dtype: str = option("auto", "autocast dtype of the attention-transfer steps (weights and Adam stay "
                                 "float32): bfloat16 took 0.47x the float32 step time on AMD EPYC with AVX512-BF16 for "
                                 "the same perplexity, 0.41x on Intel Xeon with AMX (4 blocks of 512); auto: bfloat16 "
                                 "where it is native (AVX512-BF16, AMX, a CUDA device that has it), else float32",
                                 choices=AUTOCAST_CHOICES)
    transfer_execution: str = option("decompressed", "how a transfer step runs the attention: decompressed (keys and "
                                     "values per token, the [n, n] scores materialised) or absorbed (the serving "
                                     "execution, one fused SDPA over [c, k_pe]; the same function, faster on long "
                                     "blocks: 0.66x / 0.57x the decompressed step time at 2048 / 4096 tokens in "
                                     "bfloat16 on 2 Intel Xeon threads, 1.26x on 4 blocks of 512)",
                                     choices=TRANSFER_EXECUTIONS)
    transfer_kl: float = option(0.0, "weight of an attention-weights term in the transfer loss: each step also "
                                "lowers KL(original attention weights || MLA's), mean over heads and every 4th "
                                "query in nats (on the teacher's inputs), times this. Needs --transfer-execution "
                                "decompressed; 1.74x the step time at 2048 tokens. SmolLM2-135M at KV 0.5x: 1 "
                                "lowers wiki-eval perplexity on 128 blocks of 512 (22.19 against 22.86), "
                                "recalling as many passkeys (with --repeat-share 0.5: 8 of 12 at 2048 instead of "
                                "4); on 32 blocks of 2048 it recalls fewer (8/6/0/0 of 12 at 512-4096 against "
                                "12/12/8/3); at KV 0.25x it raised perplexity (128 blocks: 40.90 against 36.72; "
                                "docs/results.md 13d); 0: the output error alone")
    transfer_weighting: str = option("uniform", "how the attention transfer weighs each token's squared error: "
                                     "uniform, or residual-norm (divided by the squared norm of the residual stream "
                                     "entering the layer at that token, the scale its RMSNorm divides out, so a "
                                     "token with massive activations does not outweigh the rest)",
                                     choices=TRANSFER_WEIGHTINGS)
    mlp_transfer_lr: float = option(0.0, "after each layer's attention transfer, also train the layer's MLP (Adam, "
                                    "this peak learning rate, the transfer's epochs, blocks per step and dtype) to "
                                    "land the layer's output on the original model's stream leaving the layer "
                                    "(pipelines/mlp_transfer.py; SmolLM2-135M at KV 0.25x, 128 blocks: 34.55 "
                                    "against 36.72 wiki-eval perplexity for 2x the conversion time, level after the "
                                    "default heal: 31.78 against 31.79; docs/results.md 13d); 0: the MLP stays the "
                                    "original's")
    transfer_target: str = option("residual", "what the transfer reproduces: residual (the original attention on "
                                  "the original model's stream plus the gap of the residual streams: the converted "
                                  "layer's residual lands on the original's), teacher (without the gap) or converted "
                                  "(the original attention on the converted stream)", choices=TRANSFER_TARGETS)
    transfer_context: int = option(0, "train the transfer for distances up to this many tokens by skipping "
                                   "positions inside each calibration block (PoSE: positions 0..c-1, c+u..n-1+u, "
                                   "cut c and skip u drawn per block; the original attention rerun there for the "
                                   "target); 0: the blocks' own positions 0..n-1")
    repeat_share: float = option(0.0, "share of the calibration blocks that end with a repeat of one of their own "
                                 "earlier spans (retrieval-shaped calibration: the original's copying heads attend "
                                 "back across the block, and the fit and the transfer learn that attention; "
                                 "SmolLM2-135M at KV 0.5x, 128 blocks: 0.5 recalls 12/8/4/4 of 12 passkeys at "
                                 "512/1024/2048/4096 against 7/4/0/0, wiki-eval perplexity 22.82 against 22.86; "
                                 "docs/results.md 13d)")
    repeat_span: int = option(64, "tokens of each repeated span (at most a quarter of the block)")
    fold_up_projections: bool = option(False, "after each layer's fit (and transfer), multiply a square K_up into "
                                       "q_proj and a square V_up into o_proj (exact, shapes unchanged): fewer "
                                       "multiply-adds per prefill and decode token, for a model served without "
                                       "heal; heal folds them itself after training them with LoRA")
    rope_context: int = option(2048, "distance L over which a slot's rotation is judged when ranking slots")
    batch_size: int = option(8, "calibration batch size")
    damping: float = option(1e-6, "relative damping of the input second moment in the whitened fit")

    def __post_init__(self):
        self._check_finite()
        if not 0.0 < self.kv_ratio <= 1.0:
            raise ValueError(f"kv_ratio (--kv-ratio) must lie in (0, 1], got {self.kv_ratio}")
        if not 0.0 <= self.rope_fraction <= 1.0:
            raise ValueError(f"rope_fraction (--rope-fraction) must lie in [0, 1], got {self.rope_fraction}")
        if self.rope_selection not in SLOT_SELECTIONS:
            raise ValueError(f"rope_selection must be one of {SLOT_SELECTIONS}, got {self.rope_selection!r}")
        if self.kv_metric not in ("diagonal", "output"):
            raise ValueError(f"kv_metric must be 'diagonal' or 'output', got {self.kv_metric!r}")
        if self.unrotated_fit not in UNROTATED_FITS:
            raise ValueError(f"unrotated_fit must be one of {UNROTATED_FITS}, got {self.unrotated_fit!r}")
        if self.rope_step < 0:
            raise ValueError(f"rope_step (--rope-step) must be >= 0 (0: chosen), got {self.rope_step}")
        if self.fit_blocks < 1 or self.fit_queries < 1:
            raise ValueError(f"fit_blocks and fit_queries must be >= 1, got {self.fit_blocks}, {self.fit_queries}")
        if self.transfer_epochs < 0 or self.transfer_batch < 1 or self.transfer_lr <= 0:
            raise ValueError(f"transfer_epochs must be >= 0, transfer_batch >= 1 and transfer_lr > 0; got "
                             f"{self.transfer_epochs}, {self.transfer_batch}, {self.transfer_lr}")
        if self.transfer_kl < 0 or (self.transfer_kl and self.transfer_execution != "decompressed"):
            raise ValueError(f"transfer_kl (--transfer-kl) must be >= 0 and, when > 0, run with --transfer-execution "
                             f"decompressed (the absorbed kernel returns no attention weights); got "
                             f"{self.transfer_kl} with {self.transfer_execution!r}")
        if self.mlp_transfer_lr < 0 or (self.mlp_transfer_lr and not self.transfer_epochs):
            raise ValueError(f"mlp_transfer_lr (--mlp-transfer-lr) must be >= 0 and, when > 0, run with "
                             f"--transfer-epochs >= 1 (its epochs); got {self.mlp_transfer_lr} with "
                             f"{self.transfer_epochs} epochs")
        if self.transfer_weighting not in TRANSFER_WEIGHTINGS:
            raise ValueError(f"transfer_weighting must be one of {TRANSFER_WEIGHTINGS}, got "
                             f"{self.transfer_weighting!r}")
        if self.transfer_context < 0:
            raise ValueError(f"transfer_context must be >= 0 (0: no skipped positions), got {self.transfer_context}")
        if not 0.0 <= self.repeat_share <= 1.0 or self.repeat_span < 1:
            raise ValueError(f"repeat_share (--repeat-share) must lie in [0, 1] and repeat_span (--repeat-span) be "
                             f">= 1; got {self.repeat_share}, {self.repeat_span}")
        if self.transfer_target not in TRANSFER_TARGETS:
            raise ValueError(f"transfer_target must be one of {TRANSFER_TARGETS}, got {self.transfer_target!r}")
        if self.transfer_dtype not in AUTOCAST_CHOICES:
            raise ValueError(f"transfer_dtype must be one of {AUTOCAST_CHOICES}, got {self.transfer_dtype!r}")
        if self.transfer_execution not in TRANSFER_EXECUTIONS:
            raise ValueError(f"transfer_execution must be one of {TRANSFER_EXECUTIONS}, got "
                             f"{self.transfer_execution!r}")
        if self.rope_context < 1 or self.batch_size < 1 or self.damping <= 0:
            raise ValueError("rope_context and batch_size must be >= 1 and damping > 0; got "
                             f"{self.rope_context}, {self.batch_size}, {self.damping}")


# Named recipes: config fields, calibration blocks and a description (the CLI's --preset; explicit flags override).
MLA_PRESETS: dict[str, dict] = {
    "quality": {
        "description": "the closed form, then 4 epochs of attention transfer on 896 calibration blocks of 512 "
                       "tokens, one block per Adam step, at skipped positions reaching 2048 (--transfer-context "
                       "2048; the default residual targets, lr 3e-3; the built-in wiki-calib holds 919): SmolLM2-135M "
                       "at KV 0.25x, 25.36 wiki-eval perplexity before healing against 184.67 training-free; healed "
                       "1.260x the original's on the first 4096 tokens, 1.222x on all of wiki-eval and 1.32x at seq "
                       "2048; 221 s of conversion per layer on 2 AMD EPYC cores in bfloat16 (--transfer-dtype "
                       "auto), plus the rope-step search over every block (70 s for 128; --rope-step N skips it); at "
                       "0.5x healed 1.046x on all of wiki-eval (docs/results.md 13d)",
        "config": {"transfer_epochs": 4, "transfer_lr": 3e-3, "transfer_target": "residual", "transfer_batch": 1,
                   "transfer_context": 2048},
        "calib_samples": 896,
    },
    "long-context": {
        "description": "quality's recipe on 131,072 calibration tokens cut into 64 blocks of 2048 (one block per "
                       "transfer step, no skipped positions): SmolLM2-135M at KV 0.25x, healed as quality's, 27.90 "
                       "wiki-eval perplexity at seq 2048 (1.60x the original's; quality 1.32x) and 31.12 at seq 512 "
                       "(1.62x; quality 1.26x); 83 s of conversion per layer on 2 Intel Xeon cores in float32 "
                       "(docs/results.md 13d)",
        "config": {"transfer_epochs": 4, "transfer_lr": 3e-3, "transfer_target": "residual", "transfer_batch": 1},
        "calib_samples": 64, "seq_len": 2048,
    },
}


@torch.no_grad()
def shared_progression_step(model: nn.Module, config: MLAConfig, calibration: torch.Tensor, m: int,
                            progress: bool = True) -> int:
    """The progression step s whose slots score highest summed over every layer (``linalg.mla.progression_totals``),
    on the original model's calibration stream: one step, so one rope base holds every layer (the export)."""
    adapter = adapter_for(model)
    layout = adapter.attention_layout(model)
    inv_freq = model_inv_freq(model)
    stream = capture_stream(model, adapter, calibration, config.batch_size)
    totals: dict[int, float] = {}
    for layer in tqdm(adapter.decoder_layers(model), desc="mla rope step", disable=not progress):
        q, k = adapter.get_linear(layer, "q"), adapter.get_linear(layer, "k")
        moments = collect_input_moments(layer, stream, {"q": q})["q"]
        score = slot_scores(q.weight, q.bias, k.weight, k.bias, moments.second_moment, moments.mean,
                            n_heads=layout.n_heads, n_kv_heads=layout.n_kv_heads, head_dim=layout.head_dim,
                            inv_freq=inv_freq, context=config.rope_context, selection="progression")
        for s, total in progression_totals(score, m).items():
            totals[s] = totals.get(s, 0.0) + total / float(score.sum().clamp_min(1e-30))  # each layer counts alike
        stream = stream.advance(layer)
    step = max(totals, key=lambda s: (totals[s], -s))
    log.info("progression step %d (summed normalised scores %s)", step, totals)
    return step


@torch.no_grad()
def rotation_fit_statistics(scores: tuple[float, int | None], layer: nn.Module, q: nn.Linear, k: nn.Linear,
                            stream: LayerStream, layout, inv_freq: torch.Tensor, blocks: int,
                            queries: int, weighting: str = "attention") -> RotationFitStatistics:
    """The original attention's statistics for the no-rotation query maps (linalg/mla_rotation_fit.py), from
    this layer's q/k projections over the first ``blocks`` calibration blocks of the stream (they start at
    position 0, no padding), ``queries`` evenly spaced queries per block; ``scores``: (scaling, sliding window);
    ``weighting``: the keys' weights in the fit (``FIT_WEIGHTINGS``)."""
    stats = RotationFitStatistics.zeros(layout.n_heads, layout.n_kv_heads, layout.head_dim, device=q.weight.device)
    scaling, window = scores
    left = blocks
    for hidden, kwargs in zip(stream.hidden, stream.layer_kwargs):
        if left <= 0:
            break
        x = layer_inputs(layer, {"q": q}, hidden, kwargs)["q"][:left]  # [b, n, d]
        left -= x.shape[0]
        b, n = x.shape[:2]
        q_out = torch.nn.functional.linear(x, q.weight, q.bias).float().view(b, n, layout.n_heads, layout.head_dim)
        k_out = torch.nn.functional.linear(x, k.weight, k.bias).float().view(b, n, layout.n_kv_heads, layout.head_dim)
        stats.update(q_out, k_out, inv_freq, scaling, window, query_stride=max(1, n // queries), weighting=weighting)
    return stats


def _restore(run_dir: RunDirectory, state: dict, model: nn.Module, adapter,
             streams: dict[str, LayerStream]) -> dict[str, LayerStream]:
    """The layers a previous run finished, rebuilt from the work directory, and the streams (file name -> stream)
    leaving the last one."""
    layers = adapter.decoder_layers(model)
    for index, layer in enumerate(layers[:state["layers_done"]]):
        adapter.set_attention(layer, rebuild_mla_attention(state["reports"][index]["spec"], adapter.attention(layer),
                                                           model))
        layer.load_state_dict(run_dir.load_tensors(f"layer_{index}"))
    return restore_streams(run_dir, streams)


def _transfer_batches(config: MLAConfig, model: nn.Module, index: int, adapter, streams: dict[str, LayerStream]):
    """The transfer's batches for layer ``index`` (still original): inputs from the converted stream, targets as
    ``config.transfer_target`` says, at skipped positions (computed there only) when ``config.transfer_context`` is
    set (seeded by the layer); the original's batches are made and dropped one at a time (docs/scaling.md)."""
    layer = adapter.decoder_layers(model)[index]
    attention, stream = adapter.attention(layer), streams["stream"]
    converted, moved = config.transfer_target == "converted", bool(config.transfer_context)
    batches = attention_batches(layer, attention, stream, adapter.cache_kwarg, targets=converted and not moved)
    teacher = None if converted else iter_attention_batches(layer, attention, streams["teacher_stream"],
                                                            adapter.cache_kwarg, targets=not moved)
    if moved:
        generator = torch.Generator().manual_seed(index)
        ids = [skipped_position_ids(h.shape[0], h.shape[1], config.transfer_context, generator)
               for h in stream.hidden]
        move = functools.partial(attention_kwargs_at, model)
        batches = at_positions(batches, ids, move, attention if converted else None)
        teacher = None if converted else (at_position(t, i, move, attention) for t, i in zip(teacher, ids))
    if not converted:  # the teacher's inputs are kept only for the attention-weights term
        gaps = (streams["teacher_stream"].hidden, stream.hidden) if config.transfer_target == "residual" else None
        batches = teacher_targets(batches, teacher, gaps, keep_reference=config.transfer_kl > 0)
    return residual_norm_weights(batches, stream.hidden) if config.transfer_weighting == "residual-norm" else batches


@torch.no_grad()
def convert_to_mla(model: nn.Module, config: MLAConfig, calibration: torch.Tensor, progress: bool = True,
                   checkpoint_dir=None, remove_checkpoint: bool = True) -> tuple[nn.Module, dict]:
    """Convert ``model`` in place (calibration token blocks [n, seq_len]); returns (model, report).

    ``checkpoint_dir`` makes the run resumable: after each layer its weights, the stream leaving it and the
    reports are written there (``pipelines.resume.RunDirectory``, fingerprinted by the settings, the calibration
    and the model); a rerun continues after the last finished layer. The directory is removed at the end unless
    ``remove_checkpoint`` is False (the caller removes it once the output is saved)."""
    start = time.perf_counter()
    check_mla_supported(model)
    adapter = adapter_for(model)
    layout = adapter.attention_layout(model)
    layers = adapter.decoder_layers(model)
    for index, layer in enumerate(layers):
        for name in ("q", "k", "v"):
            if isinstance(adapter.get_linear(layer, name), LatentLinear):
                raise ValueError(f"layer {index} projection {name!r} is a LatentLinear: this model was compressed "
                                 f"before; convert the original model to MLA (then compress its MLPs)")
    kv_rank, rope_dim = mla_budget(config.kv_ratio, layout.n_kv_heads, layout.head_dim, config.rope_fraction)
    if config.rope_selection == "progression" and rope_dim > layout.head_dim:
        raise ValueError(f"--rope-selection progression keeps at most one rotary slot per frequency pair (a rotary "
                         f"key of {layout.head_dim}); --kv-ratio {config.kv_ratio:g} with --rope-fraction "
                         f"{config.rope_fraction:g} asks {rope_dim}: lower --rope-fraction or use --rope-selection score")
    if config.rope_step and (rope_dim // 2 - 1) * config.rope_step >= layout.head_dim // 2:
        raise ValueError(f"--rope-step {config.rope_step} does not fit: {rope_dim // 2} frequencies 0, s, 2s, ... "
                         f"need (m - 1)·s < {layout.head_dim // 2}")
    limit = getattr(adapter.text_config(model), "max_position_embeddings", None) or config.transfer_context
    if config.transfer_epochs and config.transfer_context and not (calibration.shape[1] <= config.transfer_context
                                                                   <= limit):
        raise ValueError(f"--transfer-context {config.transfer_context} must lie between the calibration block "
                         f"length {calibration.shape[1]} and the model's max_position_embeddings {limit} (0: off)")
    if config.repeat_share:
        calibration = with_repeated_spans(calibration, config.repeat_share, config.repeat_span)
    inv_freq = model_inv_freq(model)
    dtype = resolve_autocast_dtype(config.transfer_dtype, next(model.parameters()))
    model.eval()
    run_dir = state = None
    if checkpoint_dir is not None:
        run_dir = RunDirectory(checkpoint_dir, layer_run_fingerprint(config, calibration, model))
        state = run_dir.load_progress()
    step = None if state is None else state["reports"][0]["rope_step"]
    if config.rope_selection == "progression" and state is None:
        step = config.rope_step or shared_progression_step(model, config, calibration, rope_dim // 2, progress)
    stream = capture_stream(model, adapter, calibration, config.batch_size)
    streams = {"stream": stream}  # with teacher targets also the original model's stream, advanced alongside
    if carries_original_stream(config):
        streams["teacher_stream"] = stream
    reports, done = [], 0
    if state is not None:
        streams = _restore(run_dir, state, model, adapter, streams)
        reports, done = state["reports"], state["layers_done"]
        log.info("resuming the MLA conversion after layer %d from %s", done - 1, run_dir.path)
    for index, layer in enumerate(tqdm(layers, desc=f"mla kv {config.kv_ratio:g}", disable=not progress)):
        if index < done:
            continue
        t0 = time.perf_counter()
        stream = streams["stream"]
        q, k, v = (adapter.get_linear(layer, name) for name in ("q", "k", "v"))
        moments = collect_input_moments(layer, stream, {"q": q})["q"]  # q, k and v read the same input
        fit = (rotation_fit_statistics(attention_score_settings(model, adapter.attention(layer)), layer, q, k, stream,
                                       layout, inv_freq, config.fit_blocks, config.fit_queries,
                                       weighting=config.unrotated_fit)
               if config.unrotated_fit != "none" else None)
        factors = mla_factors(q.weight, q.bias, k.weight, k.bias, v.weight, v.bias, moments.second_moment,
                              moments.mean, n_heads=layout.n_heads, n_kv_heads=layout.n_kv_heads,
                              head_dim=layout.head_dim, inv_freq=inv_freq, kv_rank=kv_rank, rope_dim=rope_dim,
                              context=config.rope_context, damping=config.damping, selection=config.rope_selection,
                              metric=config.kv_metric, W_o=adapter.get_linear(layer, "o").weight, rope_step=step,
                              rotation_fit=fit)
        batches = _transfer_batches(config, model, index, adapter, streams) if config.transfer_epochs else None
        if "teacher_stream" in streams:  # through the original layer, before its attention is replaced; in place
            teacher = streams["teacher_stream"]  # (no third stream beside the batches) unless it is still `stream`
            streams["teacher_stream"] = teacher.advance(layer) if teacher is stream else teacher.advance_in_place(layer)
        original = adapter.attention(layer)
        module = mla_attention_from_factors(original, model, factors)
        adapter.set_attention(layer, module)
        transfer = (transfer_attention(module, batches, epochs=config.transfer_epochs, lr=config.transfer_lr,
                                       batch_blocks=config.transfer_batch, seed=index, dtype=dtype,
                                       execution=config.transfer_execution, kl_weight=config.transfer_kl,
                                       reference_weights=functools.partial(attention_probabilities, model, original))
                    if batches is not None else None)
        del batches
        mlp = (transfer_mlp(layer, adapter.mlp(layer), layer_batches(stream, streams["teacher_stream"]),
                            epochs=config.transfer_epochs, lr=config.mlp_transfer_lr,
                            batch_blocks=config.transfer_batch, seed=index, dtype=dtype)
               if config.mlp_transfer_lr else None)
        folded = module.fold_up_projections() if config.fold_up_projections else {"k_up": False, "v_up": False}
        streams["stream"] = stream.advance(layer)
        reports.append({"layer": index, "kv_rank": module.kv_rank, "rope_dim": module.rope_dim, "folded": folded,
                        "qk_nope_dim": module.qk_nope_dim, "freq_index": module.freq_index.tolist(),
                        "unrotated_score_error": (None if factors.fit_errors is None else
                                                  {"identity": factors.fit_errors[0], "fitted": factors.fit_errors[1]}),
                        "transfer": transfer, "mlp_transfer": mlp, "spec": module.spec(), "rope_step": step,
                        "seconds": time.perf_counter() - t0})
        log.info("layer %d: MLA r=%d, rope %d, frequencies %s, transfer %s", index, module.kv_rank, module.rope_dim,
                 module.freq_index.tolist(), transfer)
        if run_dir is not None:  # the layer, the stream leaving it, the reports (each with its spec and step)
            save_layer_progress(run_dir, index, layer, streams, reports)
        release_free_heap_memory()  # the freed targets and streams: glibc keeps most of them otherwise (RSS creeps)
    if run_dir is not None and remove_checkpoint:
        run_dir.remove()
    original = 2 * layout.n_kv_heads * layout.head_dim
    return model, {"method": "mla", "config": config.to_dict(), "kv_rank": kv_rank, "rope_dim": rope_dim,
                   "rope_step": step, "transfer_dtype": dtype if config.transfer_epochs else None,
                   "cache_numbers_per_token_per_layer": kv_rank + rope_dim,
                   "original_cache_numbers_per_token_per_layer": original,
                   "kv_fraction": (kv_rank + rope_dim) / original, "layers": reports,
                   "calibration_tokens": int(calibration.numel()),
                   "timings_s": {"total": time.perf_counter() - start}}
