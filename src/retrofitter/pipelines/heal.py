"""Healing: one distillation stage for every converted model (compressed, linearized, or both).

The student (the converted model) gets LoRA factors on its projections (``modules.low_rank_delta``:
``LatentLinear`` factors ``up`` and ``mix``/``down``, dense ``nn.Linear`` weights) and learns the
teacher's (the original model's) next-token distribution with ``pipelines.distill.DistillationLoss``
on token blocks [N, seq_len]; the factors are merged exactly afterwards (same layout, same ranks). An MLA
model's square up-projections, trained apart by LoRA, are then folded into its q / o projections (exact;
``MLAAttention.fold_up_projections``).

Loop: AdamW on the LoRA factors only, linear warm-up then cosine decay over the budget (``tokens``
and/or ``minutes``, whichever ends first), gradient clipping, activation checkpointing of the decoder
layers. Step s of process p reads blocks s·b·W + p·b … + b − 1 of a seeded permutation per epoch
(W processes, b blocks each), so a resumed run sees the data an uninterrupted one would. It runs under
``accelerate`` (``prepare`` wraps the objective in DDP with several processes; gloo on CPU), or with
``sharding="fsdp"`` under FSDP2 (``pipelines.sharding``: the student's tensors sharded over the processes,
gathered whole for the merge).

Resuming (``work_dir``, ``pipelines.resume.RunDirectory``): every ``checkpoint_every`` steps the
LoRA factors, the AdamW moments and the progress (step, elapsed seconds, losses) are written; a
rerun with the same settings, data and targets continues from there. With ``teacher_topk`` = k the
teacher's top-k log-probs of every block are cached there first (the teacher runs once).
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import torch
from torch import nn
from tqdm.auto import tqdm

from ..adapters import adapter_for
from ..adapters.mla_attention import fold_mla_up_projections
from ..config import HealConfig
from ..modules.latent_linear import LatentLinear
from ..modules.low_rank_delta import (add_low_rank_delta, load_low_rank_delta_state, low_rank_delta_state,
                                      low_rank_deltas, merge_low_rank_deltas)
from .distill import DistillationLoss, teacher_topk
from .resume import RunDirectory, fingerprint
from .sharding import (device_mesh, full_tensor, gather_into, local_numel, meta_skeleton, shard_for_training,
                       shard_like)
from .training import autocast_to, make_accelerator, resolve_autocast_dtype

__all__ = ["ATTENTION_TARGETS", "HealTarget", "heal_targets", "learning_rate", "heal_model"]

ATTENTION_TARGETS = ("q", "k", "v", "o")  # what LoLCATs adapts in a linearized model


def _is_linearized(model: nn.Module) -> bool:
    return any(type(m).__name__ == "HybridSelfAttention" for m in model.modules())


class HealTarget(NamedTuple):
    """One adapted tensor: ``module.<tensor>``, named ``name`` in the model and ``short`` inside a layer."""

    name: str
    module: nn.Module
    tensor: str
    short: str


def heal_targets(model: nn.Module, names: tuple[str, ...] = ()) -> list[HealTarget]:
    """Every tensor to adapt, in layer order.

    ``names``: adapter projection names (``q k v o gate up down``); empty = every projection of the
    decoder layers, except for a linearized model without compressed layers: q, k, v, o (LoLCATs).
    A ``LatentLinear`` contributes its two factors (``up`` and ``mix`` or ``down``), an ``nn.Linear`` its weight.
    """
    adapter = adapter_for(model)
    layers = adapter.decoder_layers(model)
    if not names:
        compressed = any(isinstance(m, LatentLinear) for m in layers.modules())
        names = ATTENTION_TARGETS if _is_linearized(model) and not compressed else adapter.linear_names
    unknown = sorted(set(names) - set(adapter.linear_names))
    if unknown:
        raise ValueError(f"unknown LoRA targets {unknown}; {adapter.family} projections: {list(adapter.linear_names)}")
    targets = []
    prefix = f"{adapter.attention_path}."
    for index, layer in enumerate(layers):
        attention = adapter.attention(layer)
        own = hasattr(attention, "heal_tensors")  # MLA: its own projections replace the adapter's q/k/v/o
        if own and any(adapter.linear_paths[name].startswith(prefix) for name in names):
            where = adapter.attention_path_in_model(index)
            for sub, module, tensor in attention.heal_tensors():
                inside = f"{sub}.{tensor}" if sub else tensor
                targets.append(HealTarget(f"{where}.{inside}", module, tensor, f"{prefix}{inside}"))
        for name in names:
            if own and adapter.linear_paths[name].startswith(prefix):
                continue
            module = adapter.get_linear(layer, name)
            path = adapter.linear_path_in_model(index, name)
            if isinstance(module, LatentLinear):
                tensors = ("up", "mix" if module.junction else "down")
            elif isinstance(module, nn.Linear):
                tensors = ("weight",)
            else:
                raise TypeError(f"{path} is a {type(module).__name__}; LoRA adapts nn.Linear and LatentLinear")
            short = adapter.linear_paths[name]
            targets += [HealTarget(f"{path}.{tensor}", module, tensor, f"{short}.{tensor}") for tensor in tensors]
    return targets


def learning_rate(config: HealConfig, step: int, progress: float) -> float:
    """lr of step ``step`` (0-based): linear warm-up, then cosine from lr to min_lr_ratio·lr as the budget's
    ``progress`` in [0, 1] (fraction of tokens or of minutes spent, whichever is larger) goes to 1."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / (config.warmup_steps + 1)
    cosine = 0.5 * (1 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


class _BlockOrder:
    """Blocks of step s for process p: positions s·b·W + p·b + j of the seeded per-epoch permutations."""

    def __init__(self, n_blocks: int, batch: int, world: int, rank: int, seed: int):
        self.n_blocks, self.batch, self.world, self.rank, self.seed = n_blocks, batch, world, rank, seed
        self._orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            self._orders = {epoch: torch.randperm(self.n_blocks, generator=torch.Generator().manual_seed(self.seed + epoch))}
        return self._orders[epoch]

    def indices(self, step: int) -> list[int]:
        first = (step * self.world + self.rank) * self.batch
        return [int(self._order(i // self.n_blocks)[i % self.n_blocks]) for i in range(first, first + self.batch)]


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """AdamW state as flat safetensors entries ``"<param index>.<field>"``."""
    return {f"{index}.{key}": value.detach().reshape(-1) if value.ndim == 0 else value.detach()
            for index, fields in optimizer.state_dict()["state"].items() for key, value in fields.items()}


def _load_optimizer_tensors(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of :func:`_optimizer_tensors`; moments of a sharded (FSDP2) parameter are sharded like it."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        index, field = key.split(".", 1)
        value = value.reshape(()) if field == "step" else shard_like(value, params[int(index)])
        state.setdefault(int(index), {})[field] = value
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})


def _topk_name(block: int) -> str:
    return f"teacher_topk/block_{block:05d}"


def _cache_teacher_topk(teacher, blocks, config, run_dir: RunDirectory, state: dict, accelerator, progress) -> None:
    """Write the teacher's top-k log-probs of every block (main process; skipped when already cached)."""
    if not state.get("topk_cached"):
        if accelerator.is_main_process:
            device = next(teacher.parameters()).device
            for index in tqdm(range(blocks.shape[0]), desc="teacher top-k", disable=not progress, leave=False):
                values, ids = teacher_topk(teacher, blocks[index:index + 1].to(device), config.teacher_topk,
                                           config.chunk_tokens)
                run_dir.save_tensors(_topk_name(index), {"values": values[0], "index": ids[0].to(torch.int32)})
            state["topk_cached"] = True
            run_dir.save_progress(state)
        accelerator.wait_for_everyone()
        state.update(run_dir.load_progress())


def _load_topk(run_dir: RunDirectory, indices: list[int], device):
    parts = [run_dir.load_tensors(_topk_name(i), device) for i in indices]
    return torch.stack([p["values"] for p in parts]), torch.stack([p["index"].long() for p in parts])


class _Run(NamedTuple):
    """What a heal run carries between its steps: resume state and the prepared training objects."""

    run_dir: RunDirectory | None
    state: dict  # step, elapsed, losses, finished (+ stopped_by)
    resumed_from: int
    objective: nn.Module
    optimizer: torch.optim.Optimizer  # as prepared by accelerate
    raw_optimizer: torch.optim.Optimizer  # its AdamW (checkpointed moments)
    trainable: list[nn.Parameter]
    skeleton: nn.Module | None  # FSDP2: the meta model the shards are gathered into
    held: int  # this process's share of the student's parameters
    autocast: str  # the steps' autocast dtype (config.autocast resolved: training.resolve_autocast_dtype)


def _check_inputs(teacher, blocks: torch.Tensor, config: HealConfig) -> None:
    if blocks.ndim != 2 or blocks.shape[1] < 2:
        raise ValueError(f"training blocks must be [N, seq_len >= 2]; got {tuple(blocks.shape)}")
    if teacher is None and config.nll_weight < 1:
        raise ValueError("the KL loss needs the teacher (the original model); pass one or set nll_weight=1")


def _attach_lora(student: nn.Module, teacher, config: HealConfig) -> list[HealTarget]:
    """Freeze both models and give the student's targets LoRA factors (the same A init on every process)."""
    targets = heal_targets(student, config.targets)
    for p in student.parameters():
        p.requires_grad_(False)
    if teacher is not None:
        teacher.eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
    torch.manual_seed(config.seed)
    for target in targets:
        add_low_rank_delta(target.module, target.tensor, config.lora_rank, config.lora_alpha)
    return targets


def _resume(student, teacher, blocks, config: HealConfig, targets, work_dir, accelerator, progress):
    """``(run_dir, state, saved optimizer tensors)``: a previous run's LoRA factors loaded when ``work_dir`` has
    them (checkpoints hold whole tensors: a run may resume under the other sharding); the top-k cache filled."""
    state, saved_optimizer = {"step": 0, "elapsed": 0.0, "losses": [], "finished": False}, None
    if work_dir is None:
        if config.teacher_topk:
            raise ValueError("teacher_topk caches the teacher's top-k in the work dir: give a work_dir")
        return None, state, None
    settings = {k: v for k, v in config.to_dict().items() if k not in ("checkpoint_every", "sharding")}
    run_dir = RunDirectory(work_dir, fingerprint(settings, blocks, [t.name for t in targets], accelerator.num_processes))
    saved = run_dir.load_progress()
    if saved is not None and saved.get("step", 0) > 0:
        load_low_rank_delta_state(student, run_dir.load_tensors("lora"))
        saved_optimizer = run_dir.load_tensors("optimizer")
    state.update(saved or {})
    if config.teacher_topk:
        _cache_teacher_topk(teacher, blocks, config, run_dir, state, accelerator, progress)
    return run_dir, state, saved_optimizer


def _prepare(student, teacher, config: HealConfig, accelerator, run_dir, state, saved_optimizer) -> _Run:
    """The objective (student + teacher + loss), its AdamW on the LoRA factors, DDP or FSDP2 around them."""
    world = accelerator.num_processes
    sharded = config.sharding == "fsdp" and world > 1
    if config.gradient_checkpointing:
        student.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    objective = DistillationLoss(student, None if config.teacher_topk else teacher, chunk_tokens=config.chunk_tokens,
                                 nll_weight=config.nll_weight, temperature=config.temperature)
    skeleton = None
    if sharded:  # FSDP2: the student's tensors sharded over the processes (the teacher stays whole)
        skeleton = meta_skeleton(student)
        shard_for_training(objective, student, device_mesh(accelerator.device, world))
    trainable = [p for delta in low_rank_deltas(student).values() for p in delta.parameters()]
    held = sum(local_numel(p) for p in student.parameters())
    optimizer = raw_optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=0.0)
    if saved_optimizer is not None:
        _load_optimizer_tensors(optimizer, saved_optimizer)
    if sharded:
        optimizer = accelerator.prepare(optimizer)
    else:
        objective, optimizer = accelerator.prepare(objective, optimizer)
    objective.train()
    autocast = resolve_autocast_dtype(config.autocast, trainable[0])
    return _Run(run_dir, state, state["step"], objective, optimizer, raw_optimizer, trainable, skeleton, held,
                autocast)


def _save_checkpoint(run: _Run, student, accelerator) -> None:
    if run.run_dir is not None:  # every process gathers sharded tensors, the main process writes
        lora = {k: full_tensor(v) for k, v in low_rank_delta_state(student).items()}
        moments = {k: full_tensor(v) for k, v in _optimizer_tensors(run.raw_optimizer).items()}
        if accelerator.is_main_process:
            run.run_dir.save_tensors("lora", lora)
            run.run_dir.save_tensors("optimizer", moments)
            run.run_dir.save_progress(run.state)
    accelerator.wait_for_everyone()


def _train(run: _Run, student, blocks, config: HealConfig, accelerator, progress, on_step, description) -> str:
    """Optimizer steps until the token or time budget is spent (or the run had finished); returns why it stopped."""
    world, state = accelerator.num_processes, run.state
    max_steps = math.ceil(config.tokens / (config.batch_size * config.seq_len * world)) if config.tokens else None
    budget_s = config.minutes * 60 or None
    order = _BlockOrder(blocks.shape[0], config.batch_size, world, accelerator.process_index, config.seed)
    device = accelerator.device
    start, previous = time.perf_counter(), state["elapsed"]
    stopped_by = "finished earlier" if state["finished"] else None
    bar = tqdm(total=max_steps, initial=state["step"], desc=description, disable=not progress, leave=False)
    while stopped_by is None:
        elapsed = previous + time.perf_counter() - start
        if world > 1 and budget_s:  # every process stops at the same step
            elapsed = float(accelerator.reduce(torch.tensor([elapsed], device=device), reduction="mean")[0])
        if max_steps is not None and state["step"] >= max_steps:
            stopped_by = "tokens"
            break
        if budget_s and elapsed >= budget_s:
            stopped_by = "minutes"
            break
        fraction = max(state["step"] / max_steps if max_steps else 0.0, elapsed / budget_s if budget_s else 0.0)
        for group in run.optimizer.param_groups:
            group["lr"] = learning_rate(config, state["step"], fraction)
        indices = order.indices(state["step"])
        topk = _load_topk(run.run_dir, indices, device) if config.teacher_topk else None
        with autocast_to(run.autocast, device):  # backward outside, as autocast asks
            loss = run.objective(blocks[indices].to(device), topk)
        accelerator.backward(loss)
        if config.grad_clip:
            accelerator.clip_grad_norm_(run.trainable, config.grad_clip)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        value = float(accelerator.reduce(loss.detach(), reduction="mean")) if world > 1 else float(loss.detach())
        state["step"] += 1
        state["losses"].append(value)
        state["elapsed"] = previous + time.perf_counter() - start
        bar.update(1)
        bar.set_postfix(loss=f"{value:.4f}")
        if state["step"] % config.checkpoint_every == 0:
            _save_checkpoint(run, student, accelerator)
        if on_step is not None:
            on_step(state["step"], value)
    bar.close()
    if stopped_by != "finished earlier":
        state["finished"], state["stopped_by"] = True, stopped_by
        _save_checkpoint(run, student, accelerator)
    return stopped_by


def _merge(run: _Run, student, config: HealConfig, accelerator) -> tuple[nn.Module, int]:
    """The whole student (gathered from FSDP2 shards / unwrapped from DDP) with its LoRA factors merged, frozen,
    and how many MLA up-projections were folded after the merge."""
    sharded = run.skeleton is not None
    student = gather_into(run.skeleton, student) if sharded else accelerator.unwrap_model(run.objective).model
    merge_low_rank_deltas(student)
    # MLA: LoRA trained K_up / V_up (and q / o) apart; merged, the square ones fold into q / o (exact, cheaper to run)
    folded = fold_mla_up_projections(student)
    if config.gradient_checkpointing:
        student.activation_checkpointing_disable()
    student.eval()
    for p in student.parameters():
        p.requires_grad_(False)
    return student, folded


def _report(run: _Run, config: HealConfig, targets, world: int, stopped_by: str, seconds_this_run: float,
            n_trainable: int, folded: int) -> dict:
    state, losses = run.state, run.state["losses"]
    window = max(1, len(losses) // 4)
    return {
        "steps": state["step"], "tokens": int(state["step"] * config.batch_size * config.seq_len * world),
        "seconds": state["elapsed"], "seconds_this_run": seconds_this_run, "resumed_from_step": run.resumed_from,
        "stopped_by": state.get("stopped_by", stopped_by), "processes": world, "trainable_parameters": n_trainable,
        "sharding": "fsdp" if run.skeleton is not None else "ddp" if world > 1 else "none",
        "parameters_per_process": run.held, "adapted_tensors": len(targets), "targets": sorted({t.short for t in targets}),
        "loss": "kl" if config.nll_weight == 0 else "next_token" if config.nll_weight == 1 else "kl+next_token",
        "loss_first": sum(losses[:window]) / window if losses else None,
        "loss_last": sum(losses[-window:]) / window if losses else None,
        "loss_history": losses, "autocast": run.autocast, "config": config.to_dict(),
        "folded_up_projections": folded,
    }


def heal_model(student: nn.Module, teacher: nn.Module | None, blocks: torch.Tensor, config: HealConfig, *,
               accelerator=None, work_dir=None, progress: bool = True, on_step=None,
               description: str = "heal") -> tuple[nn.Module, dict]:
    """Distil ``teacher`` into ``student`` (in place) through merged LoRA; returns ``(student, report)``.

    ``blocks`` [N, seq_len] token ids (every process passes the same); ``teacher`` may be None for
    next-token loss alone (``nll_weight`` = 1). ``work_dir`` makes the run resumable. ``on_step(step,
    loss)`` is called after every optimizer step (progress reporting; tests interrupt through it).
    Steps: check, attach LoRA, resume, prepare (DDP / FSDP2), train, merge, report.
    """
    _check_inputs(teacher, blocks, config)
    accelerator = accelerator or make_accelerator(next(student.parameters()).device)
    targets = _attach_lora(student, teacher, config)
    run_dir, state, saved_optimizer = _resume(student, teacher, blocks, config, targets, work_dir, accelerator,
                                              progress)
    run = _prepare(student, teacher, config, accelerator, run_dir, state, saved_optimizer)
    start = time.perf_counter()
    stopped_by = _train(run, student, blocks, config, accelerator, progress, on_step, description)
    seconds_this_run = time.perf_counter() - start
    n_trainable = sum(p.numel() for p in run.trainable)  # DTensor numel: the whole tensor's
    student, folded = _merge(run, student, config, accelerator)
    return student, _report(run, config, targets, accelerator.num_processes, stopped_by, seconds_this_run, n_trainable,
                            folded)
