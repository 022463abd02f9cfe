"""LoLCATs linearization pipeline (design.md §4): swap attention, attention transfer, LoRA.

1. ``swap``: every decoder layer's attention (except ``keep_softmax_layers``) becomes a
   ``HybridSelfAttention`` (window softmax + linear attention over older keys) that reuses the
   original projections.
2. Stage 1, attention transfer: only feature maps and mixing weights train. For layer l with
   teacher input x_l (the original model's hidden state, so errors do not accumulate):

       L_l = 1000 · mean_{b,h,n,d} (y_student(x_l) − y_teacher(x_l))²     (outputs before o_proj)

   Each layer's loss is backpropagated as soon as it is computed: the graph of one layer's
   chunked hybrid attention is alive at a time, so memory is linear in the sequence length.
   ``joint`` mode runs the teacher model once per batch (all layers learn together);
   ``blockwise`` mode caches each layer's teacher inputs to disk once and trains layers one by one
   (resumable via ``progress.json``; with several processes, layer l trains on rank l mod world).
   With ``keep_softmax_top`` K, K layers get softmax back, ranked by ``keep_softmax_by``: the largest
   transfer MSE or recall gain (after this stage) or retrieval score or reach (before it: ``recall_layers``).
3. Stage 2: LoRA trained by the healing stage (KL to the original model by default, or next-token
   loss: ``lora_loss``), merged into the weights (``pipelines.lora``).

Loops run under ``accelerate``: data are sharded by process and gradients averaged (stage 1 keeps
its per-layer backward, so it all-reduces gradients itself instead of wrapping the model in DDP).
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..adapters.hybrid_attention import HybridSelfAttention, hybrid_attention_modules, restore_softmax, swap_to_hybrid
from ..config import LinearizeConfig
from ..modules.feature_maps import FEATURE_MAPS
from ..ops.hybrid_common import LINEAR_WEIGHTS, WINDOW_KINDS
from .lora import lora_finetune
from .recall_layers import RANKINGS, keep_softmax_for_recall
from .resume import RunDirectory, fingerprint
from .training import make_accelerator

__all__ = ["check_linearize_config", "TRANSFER_LOSS_SCALE", "TransferRecorder", "swap_attention", "transfer_mse", "attention_transfer",
           "restore_worst_layers", "linearize_model"]

log = logging.getLogger(__name__)

TRANSFER_LOSS_SCALE = 1000.0  # LoLCATs scales the attention-output MSE so Adam sees O(1) losses


class TransferRecorder:
    """Hook given to hybrid modules in transfer mode: per-layer MSE, optional immediate backward."""

    def __init__(self, backward: bool):
        self.backward = backward
        self.sums: dict[int, float] = defaultdict(float)
        self.powers: dict[int, float] = defaultdict(float)  # mean square of the teacher outputs
        self.counts: dict[int, int] = defaultdict(int)

    def __call__(self, layer_idx: int, student: torch.Tensor, teacher: torch.Tensor) -> None:
        mse = F.mse_loss(student.float(), teacher.float())
        if self.backward:
            (TRANSFER_LOSS_SCALE * mse).backward()
        self.sums[layer_idx] += float(mse.detach())
        self.powers[layer_idx] += float(teacher.detach().float().pow(2).mean())
        self.counts[layer_idx] += 1

    def means(self) -> dict[int, float]:
        return {layer: self.sums[layer] / self.counts[layer] for layer in sorted(self.sums)}

    def relative(self) -> dict[int, float]:
        """MSE / mean square of the teacher output per layer (comparable across layers of different scale)."""
        return {layer: self.sums[layer] / self.powers[layer] for layer in sorted(self.sums)}


class _TransferMode:
    """Context: hybrid modules return teacher outputs and report (student, teacher) to ``recorder``."""

    def __init__(self, modules, recorder):
        self.modules, self.recorder = list(modules), recorder

    def __enter__(self):
        for module in self.modules:
            module.transfer_hook = self.recorder

    def __exit__(self, *exc):
        for module in self.modules:
            module.transfer_hook = None


def check_linearize_config(config: LinearizeConfig) -> None:
    """The names in ``config`` exist in the registries of feature maps, window kinds and linear weights."""
    choices = {"feature_map": FEATURE_MAPS, "window_kind": WINDOW_KINDS, "linear_weight": LINEAR_WEIGHTS}
    for name, options in choices.items():
        if getattr(config, name) not in options:
            raise ValueError(f"unknown {name} {getattr(config, name)!r}; choose one of {sorted(options)}")


def swap_attention(model: nn.Module, config: LinearizeConfig) -> list[int]:
    """Replace attention modules in place with hybrid ones; returns the replaced layer indices."""
    return swap_to_hybrid(model, config.hybrid_settings(), config.keep_softmax_layers)


def _trainable_transfer_parameters(modules) -> list[nn.Parameter]:
    return [p for module in modules for p in module.hybrid.trainable_parameters()]


def _freeze_all_but(model: nn.Module, parameters) -> None:
    keep = {id(p) for p in parameters}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)


def _shard(blocks: torch.Tensor, accelerator) -> torch.Tensor:
    """This process's share of the blocks (every process gets the same number of steps)."""
    world = accelerator.num_processes
    usable = (blocks.shape[0] // world) * world or blocks.shape[0]
    return blocks[:usable][accelerator.process_index::world]


def _average_gradients(parameters, accelerator) -> None:
    if accelerator.num_processes == 1:
        return
    for p in parameters:
        if p.grad is not None:
            p.grad.copy_(accelerator.reduce(p.grad, reduction="mean"))


@torch.no_grad()
def transfer_mse(model: nn.Module, blocks: torch.Tensor, batch_size: int = 1, relative: bool = False
                 ) -> dict[int, float]:
    """Per-layer attention-output MSE (student vs teacher on teacher inputs) over ``blocks`` [N, n];
    ``relative``: divided by the mean square of the teacher outputs."""
    modules = hybrid_attention_modules(model).values()
    recorder = TransferRecorder(backward=False)
    device = next(model.parameters()).device
    with _TransferMode(modules, recorder):
        for start in range(0, blocks.shape[0], batch_size):
            model(input_ids=blocks[start:start + batch_size].to(device), use_cache=False)
    return recorder.relative() if relative else recorder.means()


def _joint_transfer(model, blocks, config, accelerator, progress) -> dict:
    """All layers at once: one teacher forward per batch, per-layer backward inside it."""
    modules = list(hybrid_attention_modules(model).values())
    parameters = _trainable_transfer_parameters(modules)
    _freeze_all_but(model, parameters)
    optimizer = torch.optim.Adam(parameters, lr=config.transfer_lr)
    device = accelerator.device
    local = _shard(blocks, accelerator)
    history: dict[int, list[float]] = defaultdict(list)
    steps = range(0, local.shape[0], config.batch_size)
    for epoch in range(config.transfer_epochs):
        for start in tqdm(steps, desc=f"attention transfer (epoch {epoch + 1})", disable=not progress, leave=False):
            recorder = TransferRecorder(backward=True)
            with torch.no_grad(), _TransferMode(modules, recorder):
                model(input_ids=local[start:start + config.batch_size].to(device), use_cache=False)
            _average_gradients(parameters, accelerator)
            if config.grad_clip:
                torch.nn.utils.clip_grad_norm_(parameters, config.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            for layer, mse in recorder.means().items():
                history[layer].append(mse)
    return {"mode": "joint", "steps": len(steps) * config.transfer_epochs, "train_mse_history": dict(history)}


# ---- block-wise mode: the work directory (pipelines/resume.py) holds inputs/layer_LLL/batch_BBBBB,
# params/layer_LLL and the progress {"captured", "n_batches", "done_layers": {layer: mse per epoch}}.
def _input_name(layer: int, batch: int) -> str:
    return f"inputs/layer_{layer:03d}/batch_{batch:05d}"


def _rotary_name(layer: int) -> str:
    return f"inputs/layer_{layer:03d}/rotary"


def _params_name(layer: int) -> str:
    return f"params/layer_{layer:03d}"


@torch.no_grad()
def _capture_layer_inputs(model, modules, blocks, batch_size, run_dir: RunDirectory, progress: bool) -> int:
    """Teacher pass: write every hybrid layer's attention input per batch to ``inputs/L{l}/B{i}``."""
    device = next(model.parameters()).device
    batch_index = {"value": 0}

    def grab(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        run_dir.save_tensors(_input_name(module.layer_idx, batch_index["value"]), {"hidden": hidden})
        if batch_index["value"] == 0:  # per layer: layer types may differ in rotary table (Gemma 3)
            cos, sin = kwargs["position_embeddings"]
            run_dir.save_tensors(_rotary_name(module.layer_idx), {"cos": cos, "sin": sin})

    handles = [m.register_forward_pre_hook(grab, with_kwargs=True) for m in modules]
    for m in modules:
        m.mode = "softmax"  # the teacher: later layers see original-model inputs
    try:
        steps = range(0, blocks.shape[0], batch_size)
        for index, start in enumerate(tqdm(steps, desc="caching teacher inputs", disable=not progress, leave=False)):
            batch_index["value"] = index
            model(input_ids=blocks[start:start + batch_size].to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
        for m in modules:
            m.mode = "hybrid"
    return len(steps)


def _train_one_layer(module: HybridSelfAttention, run_dir: RunDirectory, n_batches: int, config, accelerator,
                     shard_batches: bool) -> list[float]:
    """Train one layer's feature maps + mixing weights on its cached teacher inputs; MSE per epoch."""
    device = accelerator.device
    rotary = run_dir.load_tensors(_rotary_name(module.layer_idx), device)
    position_embeddings = (rotary["cos"], rotary["sin"])
    parameters = module.hybrid.trainable_parameters()
    optimizer = torch.optim.Adam(parameters, lr=config.transfer_lr)
    batches = list(range(n_batches))
    if shard_batches:
        batches = batches[accelerator.process_index::accelerator.num_processes]
    epoch_mse = []
    for _ in range(config.transfer_epochs):
        total = 0.0
        for index in batches:
            hidden = run_dir.load_tensors(_input_name(module.layer_idx, index), device)["hidden"]
            with torch.no_grad():
                q, k, v = module.project(hidden, position_embeddings)
                teacher = module.softmax_attention(q, k, v, None)
            student, _ = module.hybrid(q, k, v)
            mse = F.mse_loss(student.float(), teacher.float())
            (TRANSFER_LOSS_SCALE * mse).backward()
            if shard_batches:
                _average_gradients(parameters, accelerator)
            if config.grad_clip:
                torch.nn.utils.clip_grad_norm_(parameters, config.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total += float(mse.detach())
        epoch_mse.append(total / max(len(batches), 1))
    return epoch_mse


def _blockwise_transfer(model, blocks, config, accelerator, progress, work_dir) -> dict:
    """Cache teacher inputs per layer once, then train layers one by one; resumable."""
    modules = hybrid_attention_modules(model)
    _freeze_all_but(model, _trainable_transfer_parameters(modules.values()))
    # what the trained layers depend on (stage 2 and the restore after stage 1 do not change them)
    transfer_fields = {k: v for k, v in config.to_dict().items()
                       if not k.startswith("lora") and k != "keep_softmax_top"}
    run_dir = RunDirectory(work_dir, fingerprint(transfer_fields, blocks, sorted(modules)))
    state = run_dir.load_progress() or {"captured": False, "done_layers": {}}
    accelerator.wait_for_everyone()  # all processes read the state before the main process changes it
    if not state["captured"]:
        if accelerator.is_main_process:
            n_batches = _capture_layer_inputs(model, modules.values(), blocks, config.batch_size, run_dir, progress)
            state.update(captured=True, n_batches=n_batches)
            run_dir.save_progress(state)
        accelerator.wait_for_everyone()
        state = run_dir.load_progress()
    else:
        log.info("block-wise transfer: teacher inputs already cached in %s", run_dir.path)
    world, rank = accelerator.num_processes, accelerator.process_index
    # Layers are independent: one per process when there are several (no gradient exchange needed).
    todo = [layer for layer in sorted(modules) if str(layer) not in state["done_layers"]]
    for layer in tqdm(todo, desc="block-wise transfer", disable=not progress, leave=False):
        if world > 1 and layer % world != rank:
            continue
        module = modules[layer]
        epoch_mse = _train_one_layer(module, run_dir, state["n_batches"], config, accelerator, shard_batches=False)
        run_dir.save_tensors(_params_name(layer), module.hybrid.state_dict())
        if world == 1:
            state["done_layers"][str(layer)] = epoch_mse
            run_dir.save_progress(state)
        else:
            (run_dir.path / f"{_params_name(layer)}.json").write_text(json.dumps(epoch_mse))
        log.info("transfer layer %d: mse per epoch %s", layer, epoch_mse)
    accelerator.wait_for_everyone()
    if world > 1 and accelerator.is_main_process:
        for layer in todo:
            state["done_layers"][str(layer)] = json.loads((run_dir.path / f"{_params_name(layer)}.json").read_text())
        run_dir.save_progress(state)
    accelerator.wait_for_everyone()
    state = run_dir.load_progress()
    for layer, module in modules.items():  # done earlier, by another process, or just now: load the same bytes
        device = next(module.hybrid.parameters()).device
        module.hybrid.load_state_dict(run_dir.load_tensors(_params_name(layer), device))
    return {"mode": "blockwise", "work_dir": str(run_dir.path),
            "resumed_layers": sorted(set(map(int, modules)) - set(todo)),
            "train_mse_history": {int(k): v for k, v in state["done_layers"].items()}}


def attention_transfer(model: nn.Module, blocks: torch.Tensor, config: LinearizeConfig, accelerator=None,
                       progress: bool = True, work_dir=None, mse_blocks: int = 2) -> dict:
    """Stage 1 on token ``blocks`` [N, seq_len]; returns per-layer MSE before/after and the history.

    ``work_dir`` is required for ``transfer_mode="blockwise"`` (teacher inputs + progress file).
    """
    accelerator = accelerator or make_accelerator(next(model.parameters()).device)
    modules = hybrid_attention_modules(model)
    if not modules:
        raise ValueError("the model has no hybrid attention layers; call swap_attention first")
    was_training = model.training
    model.eval()  # no dropout: the transfer target must be deterministic
    probe = blocks[:mse_blocks]
    before = transfer_mse(model, probe, config.batch_size)
    start = time.perf_counter()
    if config.transfer_mode == "blockwise":
        if work_dir is None:
            raise ValueError("transfer_mode='blockwise' needs a work_dir for the cached teacher inputs")
        details = _blockwise_transfer(model, blocks, config, accelerator, progress, work_dir)
    else:
        details = _joint_transfer(model, blocks, config, accelerator, progress)
    seconds = time.perf_counter() - start
    after = transfer_mse(model, probe, config.batch_size)
    relative_after = transfer_mse(model, probe, config.batch_size, relative=True)
    for p in model.parameters():
        p.requires_grad_(False)
    model.train(was_training)
    layers = {layer: {"mse_before": before[layer], "mse_after": after[layer],
                      "relative_mse_after": relative_after[layer]} for layer in sorted(before)}
    return {**details, "seconds": seconds, "tokens": int(blocks.numel()), "probe_blocks": int(probe.shape[0]),
            "layers": layers, "gamma": {layer: m.hybrid.gamma.detach().cpu().tolist() for layer, m in modules.items()}}


def restore_worst_layers(model: nn.Module, layers: dict, count: int, key: str = "mse_after") -> list[int]:
    """Softmax attention back in the ``count`` layers with the largest ``key`` of stage 1's ``layers``
    report ({layer: {"mse_after": ..., "relative_mse_after": ...}}); returns them sorted."""
    if count > len(layers):
        raise ValueError(f"keep_softmax_top {count} exceeds the {len(layers)} hybrid layers")
    worst = sorted(layers, key=lambda layer: layers[layer][key], reverse=True)[:count]
    return restore_softmax(model, worst)


def keep_ranked_layers(model: nn.Module, config: LinearizeConfig, probes: list, report: dict, progress: bool) -> None:
    """Softmax back in the ``config.keep_softmax_top`` layers ranked by ``config.keep_softmax_by`` on ``probes``;
    the ranking goes to ``report["recall_ranking"]``, the layers to ``report["restored_softmax_layers"]``."""
    ranking = keep_softmax_for_recall(model, probes, config.keep_softmax_top, progress, by=config.keep_softmax_by)
    report["recall_ranking"] = ranking
    report["restored_softmax_layers"] = ranking["restored_softmax_layers"]


def linearize_model(model: nn.Module, config: LinearizeConfig, transfer_blocks: torch.Tensor | None,
                    lora_blocks: torch.Tensor | None, accelerator=None, progress: bool = True, work_dir=None,
                    on_stage=None, teacher: nn.Module | None = None,
                    recall_probes: list | None = None) -> tuple[nn.Module, dict]:
    """Swap + stage 1 + stage 2 in place. ``on_stage(name, model)`` is called after each stage
    (``swap``, ``transfer``, ``lora``), e.g. to evaluate intermediate models. ``teacher``: the original
    model of the stage-2 KL (default: a copy of ``model`` before the swap; pass the original when
    ``model`` is itself a conversion, e.g. a compressed model). ``recall_probes``: the retrieval probes
    ``keep_softmax_by="recall"`` or ``"retrieval"`` ranks layers with (``eval.passkey.retrieval_probes``). Returns ``(model, report)``."""
    check_linearize_config(config)
    ranked_by_probes = config.keep_softmax_top and config.keep_softmax_by in RANKINGS
    if ranked_by_probes and not recall_probes:
        raise ValueError(f"keep_softmax_by={config.keep_softmax_by!r} needs retrieval probes (recall_probes)")
    accelerator = accelerator or make_accelerator(next(model.parameters()).device)
    torch.manual_seed(config.seed)
    timings: dict = {}
    run_lora = lora_blocks is not None and config.lora_tokens > 0
    # The KL teacher of stage 2: the model as it is before its attention is swapped.
    if run_lora and config.lora_loss == "kl" and teacher is None:
        teacher = copy.deepcopy(model).eval()
    start = time.perf_counter()
    replaced = swap_attention(model, config)
    timings["swap"] = time.perf_counter() - start
    report: dict = {"replaced_layers": replaced, "kept_softmax_layers": sorted(config.keep_softmax_layers)}
    if on_stage:
        on_stage("swap", model)
    # retrieval and reach read the original attention: rank before stage 1, which then trains only the layers left
    if ranked_by_probes and config.keep_softmax_by != "recall":
        keep_ranked_layers(model, config, recall_probes, report, progress)
    ran_transfer = transfer_blocks is not None and config.transfer_tokens > 0
    if ran_transfer:
        report["transfer"] = attention_transfer(model, transfer_blocks, config, accelerator, progress, work_dir)
        timings["transfer"] = report["transfer"]["seconds"]
    if ranked_by_probes and config.keep_softmax_by == "recall":  # the gain of the (trained) hybrid
        keep_ranked_layers(model, config, recall_probes, report, progress)
    elif config.keep_softmax_top and config.keep_softmax_by == "mse" and ran_transfer:
        report["restored_softmax_layers"] = restore_worst_layers(model, report["transfer"]["layers"],
                                                                 config.keep_softmax_top)
    report["kept_softmax_layers"] = sorted(set(report["kept_softmax_layers"])
                                           | set(report.get("restored_softmax_layers", [])))
    if ran_transfer and on_stage:
        on_stage("transfer", model)
    if run_lora:
        model, report["lora"] = lora_finetune(model, lora_blocks, config, accelerator, progress, teacher=teacher)
        del teacher
        timings["lora"] = report["lora"]["seconds"]
        if on_stage:
            on_stage("lora", model)
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    report["timings_s"] = timings
    return model, report
