"""Attention transfer for MLA: after a layer's closed-form conversion, its ``MLAAttention`` learns the original
attention's output on the calibration blocks (LoLCATs' stage 1, here on every tensor of the new module).

For layer l with attention inputs x (the stream entering the *converted* layers 0 … l − 1, after the layer's
input norm) and targets y [b, n, d] (after ``o_proj``; below), Adam minimises

    E(θ) = Σ_batches ‖MLA_θ(x) − y‖² / Σ_batches ‖y‖²                  (relative squared error)

over θ = q_proj, kv_a_proj, k_pe_proj, K_up, V_up and o_proj, ``epochs`` passes over the calibration blocks in a
seeded order, ``batch_blocks`` blocks per step, learning rate ``lr`` with cosine decay to 0; the steps run the
module's ``decompressed`` execution (modules/mla_attention.py) or its ``absorbed`` one (``execution``: the same
function, one fused SDPA over the shared key [c, k_pe] instead of materialised [n, n] scores; on 2 Intel Xeon threads
in bfloat16 a step over one block of 2048 / 4096 tokens took 0.66× / 0.57× the decompressed step's time, over 4
blocks of 512 1.26×), optionally under bfloat16 autocast (``dtype``: a decompressed step took 0.47× the float32
time on AMD EPYC with AVX512-BF16, for the same perplexity; benchmarks/mla_transfer_step.py, docs/results.md §13d).
E is measured on every block before and after; if training did not lower it the closed-form weights are put back,
so the transfer never leaves a layer worse on its calibration data (at the full budget the closed form is exact and
stays so).

With ``kl_weight`` λ > 0 (``--transfer-kl``) the loss is E + λ·KL: KL(p ‖ p̂), the original attention's weights p
on the target's inputs against the module's p̂, mean over heads and every ``KL_QUERY_STRIDE``-th query, in nats
(``attention_kl``). The output error pays little for a query that reads the wrong one of two tokens with similar
values; the KL pays for it, and retrieval (finding the one earlier token that matters) is made of that.

The target y (``TRANSFER_TARGETS``): ``residual`` (the default) — the original attention on the original model's
stream x_T plus the gap of the residual streams entering the layer, y = Attn_l(x_T) + h_T − h, so the converted
layer's residual after attention lands on the original's; ``teacher`` — Attn_l(x_T) alone (each layer makes up
for the drift of the layers before it in its own output, LatentLLM's teacher targets); ``converted`` —
Attn_l(x) on the same converted-stream input (each layer mimics its original). SmolLM2-135M at KV 0.25×:
wiki-eval 43.03 / 46.29 / 48.96 (docs/results.md §13d).

Skipped positions (PoSE, Zhu et al. 2023; ``skipped_position_ids``, ``at_positions``): a block of n tokens only
shows the transfer distances below n, and an MLA layer keeps RoPE on a few frequencies only, so what it learns
there need not hold further away (the converted SmolLM2-135M's loss rises past token 512 when trained on blocks
of 512). With a target context L > n each block gets the positions 0 … c − 1, c + u … n − 1 + u (cut c, skip u
drawn per block), so pairs across the cut sit up to L − 1 apart; the targets are the original attention run at
those positions (not at the block's own), and both sides see the same rotary tables.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from ..config.fields import AUTOCAST_DTYPES
from .training import autocast_to

TRANSFER_TARGETS = ("residual", "teacher", "converted")
TRANSFER_EXECUTIONS = ("decompressed", "absorbed")  # MLAAttention executions a transfer step may run
KL_QUERY_STRIDE = 4  # the attention-KL term reads every 4th query's weights (kl_query_rows)

__all__ = ["KL_QUERY_STRIDE", "TRANSFER_EXECUTIONS", "TRANSFER_TARGETS", "AttentionBatch",
           "adam_epochs", "at_position", "at_positions", "attention_batches", "attention_kl", "batch_output",
           "carries_original_stream",
           "iter_attention_batches", "kl_query_rows", "mean_attention_kl", "reference_weights_at_rows",
           "relative_output_error", "residual_norm_weights", "skipped_position_ids", "teacher_targets",
           "transfer_attention"]


class _AttentionCalled(Exception):
    """Raised by the hook once the attention has run: the rest of the decoder layer need not."""


class AttentionBatch:
    """One block of the stream as the attention saw it: its keyword arguments (``hidden_states`` [b, n, d],
    rotary tables, mask, …), the output to learn, ``target`` [b, n, d] (the original attention's on these inputs,
    or ``teacher_targets``'), ``reference``: the keyword arguments on which the original attention gave the
    target (the teacher's inputs; None: ``kwargs`` themselves), whose attention weights ``attention_kl`` reads, and
    ``token_weights`` [b, n] w_t of each token's squared error (``residual_norm_weights``; None: 1)."""

    def __init__(self, kwargs: dict, target: torch.Tensor | None, reference: dict | None = None,
                 token_weights: torch.Tensor | None = None):
        self.kwargs, self.target, self.reference, self.token_weights = kwargs, target, reference, token_weights

    @property
    def reference_kwargs(self) -> dict:
        return self.kwargs if self.reference is None else self.reference

    def split(self, blocks: int) -> list["AttentionBatch"]:
        """Pieces of at most ``blocks`` rows; every batch-shaped tensor (first dim b) is cut alike."""
        b = self.target.shape[0]

        def cut(kwargs, s):
            return None if kwargs is None else {k: _rows(v, b, s, s + blocks) for k, v in kwargs.items()}

        weights = self.token_weights
        return [AttentionBatch(cut(self.kwargs, s), self.target[s:s + blocks], cut(self.reference, s),
                               None if weights is None else weights[s:s + blocks]) for s in range(0, b, blocks)]

    def squared_error(self, output: torch.Tensor) -> torch.Tensor:
        """Σ_t w_t ‖output_t − target_t‖² over the batch's tokens, in ``output``'s dtype."""
        return self.weighted_energy(output - self.target.to(output.dtype))

    def weighted_energy(self, values: torch.Tensor) -> torch.Tensor:
        """Σ_t w_t ‖values_t‖² for ``values`` [b, n, d]."""
        energy = values.pow(2).sum(-1)
        return (energy if self.token_weights is None else energy * self.token_weights.to(energy.dtype)).sum()


def _rows(value, batch: int, start: int, stop: int):
    if isinstance(value, torch.Tensor):
        return value[start:stop] if value.ndim and value.shape[0] == batch else value
    if isinstance(value, tuple):
        return tuple(_rows(v, batch, start, stop) for v in value)
    return value


def attention_batches(layer: nn.Module, attention: nn.Module, stream, cache_kwarg: str,
                      targets: bool = True) -> list[AttentionBatch]:
    """Per batch of ``stream`` (a ``calibration.LayerStream``): what ``attention`` (inside ``layer``) receives and
    returns when ``layer`` runs on it, without the cache (``cache_kwarg``: the adapter's name for it). The layer
    stops right after the attention (nothing else runs); with ``targets`` False right before it (the batches'
    targets are then None: for inputs whose targets come from elsewhere, ``teacher_targets``)."""
    return list(iter_attention_batches(layer, attention, stream, cache_kwarg, targets))


@torch.no_grad()
def iter_attention_batches(layer: nn.Module, attention: nn.Module, stream, cache_kwarg: str,
                           targets: bool = True) -> Iterator[AttentionBatch]:
    """``attention_batches`` one batch at a time, each made when asked for: a consumer that keeps only what it
    derives from a batch holds one batch of it at a time (the hook is removed before each batch is handed on, so
    the consumer may run ``attention`` itself)."""

    def inputs(args, kwargs) -> dict:
        kwargs = dict(kwargs)
        if args:
            kwargs["hidden_states"] = args[0]
        kwargs.pop(cache_kwarg, None)  # the transfer runs without a cache
        kwargs["hidden_states"] = kwargs["hidden_states"].detach()
        return kwargs

    def record(_module, args, kwargs, output):
        output = output[0] if isinstance(output, tuple) else output
        seen.append(AttentionBatch(inputs(args, kwargs), output.detach()))
        raise _AttentionCalled

    def record_inputs(_module, args, kwargs):
        seen.append(AttentionBatch(inputs(args, kwargs), None))
        raise _AttentionCalled

    for hidden, kwargs in zip(stream.hidden, stream.layer_kwargs):
        seen: list[AttentionBatch] = []
        handle = (attention.register_forward_hook(record, with_kwargs=True) if targets else
                  attention.register_forward_pre_hook(record_inputs, with_kwargs=True))
        try:
            layer(hidden, **kwargs)
        except _AttentionCalled:
            pass
        finally:
            handle.remove()
        yield seen[0]


def teacher_targets(batches: list[AttentionBatch], teacher: Iterable[AttentionBatch],
                    residual_streams: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
                    keep_reference: bool = True) -> list[AttentionBatch]:
    """``batches``' inputs (the converted stream) with ``teacher``'s targets: the original attention's outputs on
    the original model's stream, y_T = Attn_l(x_T), so the layer also makes up for the drift of the layers before
    it. With ``residual_streams`` (h_T, h: per batch the two residual streams entering the layer, [b, n, d] each)
    the target is y_T + (h_T − h): the converted layer's residual after attention, h + MLA(x), lands on the
    original's, h_T + y_T (pre-norm decoder layers, h + Attn(norm(h)), as every family MLA converts).

    The teacher's inputs become each batch's ``reference`` (the attention-weights term reads the original's
    weights there); ``keep_reference`` False leaves it None. ``teacher`` may be an iterator
    (``iter_attention_batches``): each of its batches is then dropped once its target is formed, so beside the
    converted batches the teacher holds a batch or two at a time, not its whole stream."""
    mismatch = ValueError("teacher targets: the streams hold different numbers of batches")
    if residual_streams is not None and any(len(h) != len(batches) for h in residual_streams):
        raise mismatch
    teacher, out = iter(teacher), []
    for i, b in enumerate(batches):
        t = next(teacher, None)
        if t is None:
            raise mismatch
        y = t.target
        if residual_streams is not None:  # y_T + (h_T − h)
            y = y + (residual_streams[0][i] - residual_streams[1][i]).to(y)
        out.append(AttentionBatch(b.kwargs, y, t.kwargs if keep_reference else None, b.token_weights))
        del t  # before the iterator makes the next teacher batch
    if next(teacher, None) is not None:
        raise mismatch
    return out


def residual_norm_weights(batches: list[AttentionBatch], hidden: list[torch.Tensor]) -> list[AttentionBatch]:
    """``batches`` with token weights w_t = 1 / ‖h_t‖² (``hidden``: per batch the residual stream h [b, n, d]
    entering the layer): each token's error then counts relative to the stream it lands on, the scale the next
    RMSNorm divides out. Without them a token with massive activations outweighs the rest (SmolLM2-135M's first
    token holds 95 % of the middle layers' squared norm)."""
    if len(batches) != len(hidden):
        raise ValueError(f"{len(batches)} batches but {len(hidden)} hidden-state tensors")
    return [AttentionBatch(b.kwargs, b.target, b.reference,
                           1.0 / h.double().pow(2).sum(-1).clamp_min(1e-300).float()) for b, h in zip(batches, hidden)]


def carries_original_stream(config) -> bool:
    """Whether an MLA conversion (``MLAConfig``) carries the original model's stream h_T beside its own: a transfer
    whose target reads it (``teacher``, ``residual``) or an MLP transfer, which learns the original's layer output."""
    return bool(config.transfer_epochs) and (config.transfer_target != "converted" or bool(config.mlp_transfer_lr))


def skipped_position_ids(rows: int, length: int, context: int, generator: torch.Generator) -> torch.Tensor:
    """Position ids [rows, length] that reach up to ``context`` − 1 (PoSE): per row a cut c ~ U{1 … n − 1} and a
    skip u ~ U{0 … L − n}; ids 0 … c − 1 then c + u … n − 1 + u (order kept, so causal masks stay as they are)."""
    if length < 2 or context < length:
        raise ValueError(f"skipped positions need blocks of >= 2 tokens and a context >= the block length; got "
                         f"blocks of {length}, context {context}")
    cut = torch.randint(1, length, (rows, 1), generator=generator)
    skip = torch.randint(0, context - length + 1, (rows, 1), generator=generator)
    ids = torch.arange(length).expand(rows, length)
    return ids + skip * (ids >= cut)


def at_positions(batches: list[AttentionBatch], position_ids: list[torch.Tensor],
                 with_positions: Callable[[dict, torch.Tensor], dict],
                 attention: nn.Module | None = None) -> list[AttentionBatch]:
    """``batches`` moved to ``position_ids`` (per batch [b, n]; ``at_position`` each)."""
    if len(batches) != len(position_ids):
        raise ValueError(f"{len(batches)} batches but {len(position_ids)} position-id tensors")
    return [at_position(batch, ids, with_positions, attention) for batch, ids in zip(batches, position_ids)]


@torch.no_grad()
def at_position(batch: AttentionBatch, position_ids: torch.Tensor,
                with_positions: Callable[[dict, torch.Tensor], dict],
                attention: nn.Module | None = None) -> AttentionBatch:
    """``batch`` moved to ``position_ids`` [b, n]: ``with_positions(kwargs, ids)`` (the adapter's) gives the
    attention's keyword arguments at those positions; with ``attention`` (the original) the target is its output
    there, else the target is kept (None for inputs whose targets come from elsewhere)."""
    kwargs = with_positions(batch.kwargs, position_ids)
    target = batch.target if attention is None else batch_output(attention, AttentionBatch(kwargs, None)).detach()
    reference = None if batch.reference is None else with_positions(batch.reference, position_ids)
    return AttentionBatch(kwargs, target, reference, batch.token_weights)


def batch_output(module: nn.Module, batch: AttentionBatch) -> torch.Tensor:
    """``module(**batch.kwargs)``, its first element when it returns a tuple (an attention or a decoder layer)."""
    out = module(**batch.kwargs)
    return out[0] if isinstance(out, tuple) else out


def attention_kl(reference: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean over batch rows, heads and queries of KL(p ‖ p̂) = Σ_j p_j (log p_j − log p̂_j), in nats: ``reference``
    p and ``weights`` p̂ [b, h, n, N] (softmax rows). Entries where p = 0 (masked) add nothing; p̂ is floored at the
    smallest normal float32 (a bfloat16 softmax underflows to 0 where float32's would not)."""
    p, q = reference.float(), weights.float().clamp_min(torch.finfo(torch.float32).tiny)
    return (torch.xlogy(p, p) - torch.xlogy(p, q)).sum(-1).mean()


def kl_query_rows(length: int) -> torch.Tensor:
    """The queries whose attention weights the KL term reads in a block of ``length``: every
    ``KL_QUERY_STRIDE``-th, the last included (a quarter of the [n, N] weights: the term's cost, and the memory
    of the original's weights kept per block, fall 4-fold)."""
    return torch.arange(length - 1, -1, -KL_QUERY_STRIDE).flip(0)


@torch.no_grad()
def reference_weights_at_rows(batches: list[AttentionBatch],
                              reference_weights: Callable[[dict], torch.Tensor]) -> list[torch.Tensor]:
    """Per batch the original attention's weights [b, h, n', N] on its reference inputs at ``kl_query_rows``."""
    rows = [kl_query_rows(batch.target.shape[1]) for batch in batches]
    return [reference_weights(batch.reference_kwargs)[:, :, r] for batch, r in zip(batches, rows)]


@torch.no_grad()
def mean_attention_kl(module: nn.Module, batches: list[AttentionBatch], references: list[torch.Tensor]) -> float:
    """``attention_kl`` of ``module``'s attention weights (its decompressed execution) at ``kl_query_rows`` against
    ``references`` (``reference_weights_at_rows``), averaged over ``batches`` weighted by their rows."""
    serving, module.execution = module.execution, "decompressed"
    try:
        total = count = 0.0
        for batch, reference in zip(batches, references):
            weights = module(**batch.kwargs)[1][:, :, kl_query_rows(batch.target.shape[1])]
            rows = reference.shape[0] * reference.shape[2]
            total += float(attention_kl(reference, weights)) * rows
            count += rows
    finally:
        module.execution = serving
    return total / max(count, 1.0)


@torch.no_grad()
def relative_output_error(module: nn.Module, batches: list[AttentionBatch]) -> float:
    """Σ_t w_t ‖module(x)_t − y_t‖² / Σ_t w_t ‖y_t‖² over ``batches``' tokens (w: their token weights, else 1;
    float64 sums)."""
    error = energy = 0.0
    for batch in batches:
        error += float(batch.squared_error(batch_output(module, batch).double()))
        energy += float(batch.weighted_energy(batch.target.double()))
    return error / max(energy, 1e-300)


def adam_epochs(parameters: list[nn.Parameter], pieces: list[AttentionBatch],
                step_loss: Callable[[int, AttentionBatch], torch.Tensor], *, epochs: int, lr: float, seed: int) -> int:
    """Adam on ``parameters``: ``epochs`` passes over ``pieces`` in a seeded order, one step per piece on
    ``step_loss(index, piece)``, learning rate ``lr`` with cosine decay to 0; the gradients are freed at the end.
    Returns the number of steps."""
    optimizer = torch.optim.Adam(parameters, lr=lr)
    generator = torch.Generator().manual_seed(seed)
    steps, total = 0, epochs * len(pieces)
    with torch.enable_grad():
        for _ in range(epochs):
            for index in torch.randperm(len(pieces), generator=generator).tolist():
                for group in optimizer.param_groups:
                    group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * steps / total))
                loss = step_loss(index, pieces[index])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                steps += 1
    optimizer.zero_grad(set_to_none=True)  # the last step's gradients would outlive the transfer, a copy of the weights
    return steps


def transfer_attention(module: nn.Module, batches: list[AttentionBatch], *, epochs: int, lr: float,
                       batch_blocks: int, seed: int = 0, dtype: str = "float32", execution: str = "decompressed",
                       kl_weight: float = 0.0,
                       reference_weights: Callable[[dict], torch.Tensor] | None = None) -> dict:
    """Train every parameter of ``module`` (an ``MLAAttention``) to reproduce ``batches``' targets (module
    docstring); returns {"error_before", "error_after", "steps", "kept", "seconds"} (``kept``: the trained weights
    were kept). The steps run the module's ``execution`` (``TRANSFER_EXECUTIONS``), under autocast to ``dtype`` unless
    "float32" (``config.fields.AUTOCAST_DTYPES``; the weights, Adam's state and the loss stay float32); the errors
    before and after are measured with its own execution in its own dtype.

    With ``kl_weight`` λ > 0 each step also matches the attention weights: the loss is E + λ·KL, KL =
    ``attention_kl`` of the original attention's weights on the batch's reference inputs,
    ``reference_weights(batch.reference_kwargs)`` [b, h, n, N] (adapters.mla_attention.attention_probabilities),
    against the module's (the decompressed execution returns them; the absorbed one does not), both at
    ``kl_query_rows``. The original's weights are computed once per piece and kept (float32, h·n/4·N numbers per
    block) for every epoch. Output error pays little for attending to the wrong one of two similar tokens; KL
    pays for it, and retrieval is made of that. The record then also holds "kl_before" / "kl_after", and the
    trained weights are kept when E + λ·KL fell."""
    if dtype not in AUTOCAST_DTYPES:
        raise ValueError(f"transfer dtype must be one of {AUTOCAST_DTYPES}, got {dtype!r}")
    if execution not in TRANSFER_EXECUTIONS:
        raise ValueError(f"transfer execution must be one of {TRANSFER_EXECUTIONS}, got {execution!r}")
    if kl_weight < 0 or (kl_weight and (reference_weights is None or execution != "decompressed")):
        raise ValueError(f"an attention-KL weight ({kl_weight}) must be >= 0, and when > 0 needs the original's "
                         f"weights (reference_weights) and the decompressed execution (got {execution!r})")
    start = time.perf_counter()
    pieces = [piece for batch in batches for piece in batch.split(batch_blocks)]
    parameters = [p for p in module.parameters()]
    initial = [p.detach().clone() for p in parameters]
    was_training = module.training
    module.train()
    before = relative_output_error(module, batches)
    references = reference_weights_at_rows(pieces, reference_weights) if kl_weight else []
    kl_before = mean_attention_kl(module, pieces, references) if kl_weight else 0.0
    energy = sum(float(batch.weighted_energy(batch.target.double())) for batch in batches)
    tokens = sum(batch.target.shape[0] * batch.target.shape[1] for batch in batches)
    scale = tokens / max(energy, 1e-300)  # the loss is O(1): squared error over the mean squared target
    flags = [p.requires_grad for p in parameters]
    serving, module.execution = module.execution, execution
    autocast = autocast_to(dtype, parameters[0].device)

    def step_loss(index: int, piece: AttentionBatch) -> torch.Tensor:
        with autocast:
            out, weights = module(**piece.kwargs)[:2]
        n = piece.target.shape[0] * piece.target.shape[1]
        loss = piece.squared_error(out.float()) * (scale / n)
        if kl_weight:
            rows = kl_query_rows(piece.target.shape[1])
            loss = loss + kl_weight * attention_kl(references[index], weights[:, :, rows])
        return loss

    try:
        for p in parameters:
            p.requires_grad_(True)
        steps = adam_epochs(parameters, pieces, step_loss, epochs=epochs, lr=lr, seed=seed)
    finally:
        module.execution = serving
        for p, flag in zip(parameters, flags):
            p.requires_grad_(flag)
    after = relative_output_error(module, batches)
    kl_after = mean_attention_kl(module, pieces, references) if kl_weight else 0.0
    kept = after + kl_weight * kl_after < before + kl_weight * kl_before
    if not kept:
        with torch.no_grad():
            for p, value in zip(parameters, initial):
                p.copy_(value)
    module.train(was_training)
    record = {"error_before": before, "error_after": after if kept else before, "steps": steps, "kept": kept}
    if kl_weight:
        record.update(kl_before=kl_before, kl_after=kl_after if kept else kl_before)
    return dict(record, seconds=time.perf_counter() - start)
