"""Public API: ``load_model``, ``evaluate``, ``compress``, ``quantize``, ``save``, ``load`` (design.md §1,
guideline 1)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .adapters import auto_class_for
from .checkpoint import check_weight_files, is_retrofitted_dir, load_retrofitted, save_retrofitted
from .config import CompressConfig, EvalConfig
from .errors import ModelLoadError
from .eval.accounting import account, tensor_leaves
from .eval.perplexity import perplexity
from .eval.record import ResultsRecord
from .eval.resources import peak_rss_mb, timed
from .modules.quantize import QUANTIZE_SCHEMES, check_scheme, quantize_model, quantized_scheme
from .pipelines.offload import load_as_copies

__all__ = ["load_model", "load", "save", "evaluate", "evaluate_record", "ResultsRecord", "quantize", "QUANTIZE_SCHEMES",
           "evaluation_blocks", "compress", "linearize", "write_json", "teacher_statistics", "compress_from_statistics",
           "global_plan_from_statistics", "finetune_lora", "heal", "load_tokenizer", "compress_out_of_core",
           "convert_to_mla", "export", "set_recall", "recall_probes", "keep_softmax_for_recall", "restore_softmax_layers"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def resolve_device(device) -> torch.device:
    """``device`` as a ``torch.device``, refused at once when this machine or torch build cannot use it."""
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            build = "this torch build has no CUDA support" if torch.version.cuda is None else "no GPU is visible"
            raise ValueError(f"device {device!r} is not available: {build}; use --device cpu")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} does not exist: {torch.cuda.device_count()} GPU(s) visible")
    elif resolved.type != "cpu" and resolved.type != "mps":
        raise ValueError(f"unsupported device {device!r}; use cpu or cuda")
    return resolved


def load_model(name_or_path: str, dtype="float32", device="cpu", quantize: str | None = None):
    """``(model, tokenizer)`` for a built-in alias, a local HF dir, a saved retrofitter dir or a hub id.

    Weights load from safetensors only; no remote code is ever executed. Any failure to read the
    model raises ``errors.ModelLoadError`` naming the model and the file at fault. ``quantize`` (a key
    of ``QUANTIZE_SCHEMES``) quantizes the loaded model's projections (see :func:`quantize`).
    """
    import transformers

    from .data.models import resolve_model_source

    dtype = resolve_dtype(dtype)
    device = resolve_device(device)
    if quantize is not None:
        check_scheme(quantize, device.type)  # before the (slow) load
    try:
        source = resolve_model_source(name_or_path)
    except FileNotFoundError as error:
        raise ModelLoadError(str(error)) from None
    if Path(source).is_dir():
        check_weight_files(source)
    try:
        if is_retrofitted_dir(source):
            model = load_retrofitted(source, dtype=dtype, device=device)
        else:
            # On CPU a same-dtype checkpoint is read as copies (pipelines/offload.py: no file mapping outlives
            # the load, so replaced weights free their memory); otherwise, or when names differ, transformers.
            model = load_as_copies(source, dtype) if device.type == "cpu" and Path(source).is_dir() else None
            if model is None:
                config = transformers.AutoConfig.from_pretrained(source, trust_remote_code=False)
                model = auto_class_for(config).from_pretrained(  # LLaVA: AutoModelForImageTextToText
                    source, config=config, dtype=dtype, use_safetensors=True, trust_remote_code=False)
            model = model.to(device).eval()
        tokenizer = _load_tokenizer(source, name_or_path)
    except ModelLoadError:
        raise
    except Exception as error:  # noqa: BLE001 — whatever transformers or safetensors raise, one clear message
        detail = " ".join(str(error).split())[:300] or type(error).__name__
        raise ModelLoadError(f"cannot load model {name_or_path!s}: {detail}") from error
    model.name_or_path = str(name_or_path)
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise ModelLoadError(f"model {name_or_path!s}: its tokenizer has {len(tokenizer)} tokens but the embedding only "
                             f"{rows} rows, so token ids past {rows - 1} have no embedding; the tokenizer belongs to "
                             f"another model: copy the model's own tokenizer files into the directory")
    if quantize is not None:
        model = quantize_model(model, quantize)
    return model, tokenizer


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _load_tokenizer(source, name_or_path):
    """The tokenizer of ``source``; a local directory without tokenizer files is refused in one line (transformers
    would answer with advice about sentencepiece)."""
    import transformers

    if Path(source).is_dir() and not any(Path(source, name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"model {name_or_path!s}: no tokenizer files in {source} (looked for "
                             f"{', '.join(TOKENIZER_FILES)}); copy the tokenizer of the model into the directory")
    return transformers.AutoTokenizer.from_pretrained(source, trust_remote_code=False)


def quantize(model: nn.Module, scheme: str) -> nn.Module:
    """Quantize in place every projection weight of ``model`` (``nn.Linear`` weights and ``LatentLinear``
    factors; embeddings and LM head stay float) with torchao ``scheme`` (``int8-weight``, ``int8-dynamic``);
    returns ``model``. For inference and evaluation: a quantized model cannot be saved."""
    return quantize_model(model, scheme)


def load(path, dtype="float32", device="cpu", quantize: str | None = None):
    """Load a saved retrofitter directory (or any model ``load_model`` accepts): returns ``(model, tokenizer)``."""
    return load_model(str(path), dtype=dtype, device=device, quantize=quantize)


def save(model: nn.Module, out, tokenizer=None, metadata: dict | None = None, overwrite: bool = False) -> Path:
    """Save a (retrofitted) model as safetensors + config.json + retrofitter.json, atomically."""
    return save_retrofitted(model, out, metadata or {}, tokenizer=tokenizer, overwrite=overwrite)


def evaluation_blocks(tokenizer, corpus: str, seq_len: int, max_tokens: int | None) -> torch.Tensor:
    from .data.blocks import token_blocks
    from .data.corpora import load_text

    return token_blocks(tokenizer, load_text(corpus), seq_len=seq_len, max_tokens=max_tokens)


def evaluate(model: nn.Module, tokenizer, config: EvalConfig = EvalConfig(), progress: bool = True,
             blocks: dict[str, torch.Tensor] | None = None, *, name: str | None = None, method: str = "original",
             ratio: float | None = None, baseline=None) -> dict:
    """``evaluate_record(...)`` as the dict the jobs write (``ResultsRecord.to_dict``), for scripts."""
    return evaluate_record(model, tokenizer, config, progress, blocks, name=name, method=method, ratio=ratio,
                           baseline=baseline).to_dict()


def evaluate_record(model: nn.Module, tokenizer, config: EvalConfig = EvalConfig(), progress: bool = True,
                    blocks: dict[str, torch.Tensor] | None = None, *, name: str | None = None,
                    method: str = "original", ratio: float | None = None, baseline=None) -> ResultsRecord:
    """The results record of ``model`` (design.md §5): perplexity on ``config.corpora`` (none when empty)
    plus accounting. This is the one place the record is built; jobs add their sections through its methods.

    ``blocks`` (optional): corpus -> token blocks already cut with this config, so that a caller
    evaluating many models tokenizes each corpus once. ``baseline`` (the ``Accounting`` of the model
    before conversion) adds ``params_before`` and the ``reduction`` of linear and total parameters.
    """
    timings: dict = {}
    ppl, details = {}, {}
    if config.corpora:
        broken = next((n for n, p in model.named_parameters()
                       if not all(torch.isfinite(t).all() for t in tensor_leaves(p))), None)
        if broken is not None:
            raise ValueError(f"the model has non-finite weights (NaN/Inf) in {broken}: its perplexity is undefined; "
                             f"re-create it from the original")
    for corpus in config.corpora:
        if blocks is not None and corpus in blocks:
            corpus_blocks = blocks[corpus]
        else:
            corpus_blocks = evaluation_blocks(tokenizer, corpus, config.seq_len, config.max_eval_tokens)
        with timed(timings, f"eval_{corpus}"):
            result = perplexity(model, corpus_blocks, batch_size=config.batch_size, progress=progress,
                                description=f"ppl {corpus}")
        ppl[corpus] = result.ppl
        details[corpus] = {"tokens": result.tokens, "blocks": result.blocks}
    accounting = account(model, context=config.context_for_macs)
    record = ResultsRecord(
        model=name or getattr(model, "name_or_path", type(model).__name__), method=method, ratio=ratio, ppl=ppl,
        params=accounting.params_dict(), bytes=accounting.bytes_dict(), macs_per_token=accounting.macs_per_token,
        attention_macs_per_token=accounting.attention_macs_per_token,
        kv_bytes_per_token=accounting.kv_bytes_per_token,
        state_bytes_per_sequence=accounting.state_bytes_per_sequence,
        settings={"seq_len": config.seq_len, "max_eval_tokens": config.max_eval_tokens,
                  "batch_size": config.batch_size, "dtype": accounting.dtype, "quantize": quantized_scheme(model),
                  "eval_tokens": details, "threads": torch.get_num_threads()},
        timings_s=timings, peak_rss_mb=peak_rss_mb())
    if accounting.notes:
        record.accounting_notes = list(accounting.notes)
    if baseline is not None:
        record.params_before = baseline.params_dict()
        record.reduction = {"linear": 1 - accounting.params_linear / baseline.params_linear,
                            "total": 1 - accounting.params_total / baseline.params_total}
    return record


def compress(model: nn.Module, config: CompressConfig, calibration: torch.Tensor, progress: bool = True,
             checkpoint_dir=None, remove_checkpoint: bool = True, parallel=None) -> tuple[nn.Module, dict]:
    """Compress ``model`` in place on ``calibration`` token blocks [n, seq_len]; returns ``(model, report)``.

    ``checkpoint_dir`` (optional) makes the run resumable: finished layers are written there and an
    interrupted run picks up after the last finished layer. ``parallel`` (a ``pipelines.distributed.
    DataParallel``): data-parallel calibration over the processes of a ``torchrun`` launch.
    """
    from .pipelines.compress import compress_model
    from .pipelines.distributed import SINGLE_PROCESS

    return compress_model(model, config, calibration, progress=progress, checkpoint_dir=checkpoint_dir,
                          remove_checkpoint=remove_checkpoint, parallel=parallel or SINGLE_PROCESS)


def convert_to_mla(model: nn.Module, config, calibration: torch.Tensor, progress: bool = True,
                   checkpoint_dir=None, remove_checkpoint: bool = True) -> tuple[nn.Module, dict]:
    """Convert every attention layer of ``model`` to Multi-head Latent Attention in place (on ``calibration`` token
    blocks [n, seq_len]; training-free unless ``config.transfer_epochs``); ``config`` is a
    ``pipelines.mla.MLAConfig`` (None: its defaults, KV 0.25). ``checkpoint_dir``: resumable, layer by layer.
    Returns ``(model, report)``."""
    from .pipelines.mla import MLAConfig
    from .pipelines.mla import convert_to_mla as convert

    return convert(model, config or MLAConfig(), calibration, progress=progress, checkpoint_dir=checkpoint_dir,
                   remove_checkpoint=remove_checkpoint)


def teacher_statistics(model: nn.Module, calibration: torch.Tensor, batch_size: int = 8, progress: bool = True) -> dict:
    """Input second moments of every projection of the original model, one pass (layer -> name -> moments):
    shared by several ``compress_from_statistics`` calls (methods × ratios) of the same model."""
    from .pipelines.compress import collect_teacher_moments

    return collect_teacher_moments(model, calibration, batch_size, progress)


def compress_from_statistics(model: nn.Module, config: CompressConfig, statistics: dict, svd_cache: dict | None = None,
                             plan: dict | None = None) -> tuple[nn.Module, dict]:
    """A local method (svd / asvd-* / svd-llm) from ``teacher_statistics``, in place; returns ``(model, report)``.

    The same ``svd_cache`` dict across calls makes another ratio cost only a truncation; ``plan``
    ((layer, name) -> rank, e.g. from ``global_plan_from_statistics``) replaces the uniform ranks.
    """
    from .pipelines.compress import compress_with_moments

    return compress_with_moments(model, config, statistics, svd_cache, plan)


def global_plan_from_statistics(model: nn.Module, config: CompressConfig, statistics: dict, svd_cache: dict,
                                calibration: torch.Tensor | None = None, importance: dict | None = None):
    """Global rank plan (``config.allocation_weighting``) from the SVDs cached by ``compress_from_statistics``;
    returns ``(plan, report)``, the fisher importance in ``report["importance"]`` for reuse at other ratios."""
    from .pipelines.compress import teacher_global_plan

    return teacher_global_plan(model, config, statistics, svd_cache, calibration, importance)


def linearize(model: nn.Module, config=None, transfer_blocks: torch.Tensor | None = None,
              lora_blocks: torch.Tensor | None = None, progress: bool = True, work_dir=None, accelerator=None,
              on_stage=None, teacher: nn.Module | None = None, recall_probes: list | None = None
              ) -> tuple[nn.Module, dict]:
    """LoLCATs in place (design.md §4): swap attention for the hybrid, stage 1 attention transfer on
    ``transfer_blocks`` [N, seq_len], stage 2 LoRA on ``lora_blocks`` then merge. Returns ``(model, report)``.

    ``config`` is a ``LinearizeConfig`` (default settings when None); ``work_dir`` holds the cached
    teacher inputs of block-wise transfer (resumable); ``on_stage(name, model)`` runs after each stage;
    ``teacher`` is the original model of the stage-2 KL (default: ``model`` as it was before the swap);
    ``recall_probes`` (``recall_probes(tokenizer)``) are needed by ``keep_softmax_by="recall"``.
    """
    from .config import LinearizeConfig
    from .pipelines.linearize import linearize_model

    return linearize_model(model, config or LinearizeConfig(), transfer_blocks, lora_blocks, accelerator=accelerator,
                           progress=progress, work_dir=work_dir, on_stage=on_stage, teacher=teacher,
                           recall_probes=recall_probes)


def recall_probes(tokenizer, corpus: str = "wiki-calib", count: int = 4, context_tokens: int = 1024,
                  seed: int = 1234) -> list:
    """Teacher-forced retrieval probes (``eval.passkey.retrieval_probes``): a pass key hidden in ``corpus``
    text (never the evaluation's filler), ``count`` of about ``context_tokens`` tokens."""
    from .data.blocks import tokenize_text
    from .data.corpora import load_text
    from .eval.passkey import retrieval_probes

    haystack = torch.tensor(tokenize_text(tokenizer, load_text(corpus)), dtype=torch.long)
    return retrieval_probes(tokenizer, haystack, count, context_tokens, seed=seed)


def restore_softmax_layers(model: nn.Module, layers) -> list[int]:
    """Softmax attention back in the given hybrid ``layers`` of a linearized ``model`` (their current
    projections); the model then saves and caches like one linearized with those layers kept."""
    from .adapters.hybrid_attention import restore_softmax

    return restore_softmax(model, layers)


def keep_softmax_for_recall(model: nn.Module, probes: list, count: int, progress: bool = True,
                            by: str = "recall") -> dict:
    """Give softmax attention back to ``count`` hybrid layers of a linearized ``model``, in place and training-free,
    ranked on retrieval ``probes`` (``recall_probes``) ``by`` ``"recall"`` (the layers that most raise the answer
    likelihood), ``"retrieval"`` (whose original attention looks most at the needle), ``"reach"`` (whose original
    attention lies most outside the window and sinks) or ``"retrieval+reach"`` (the two in turn); returns the
    per-layer ranking and the restored layers (``pipelines.recall_layers``)."""
    from .pipelines.recall_layers import keep_softmax_for_recall as keep_layers

    return keep_layers(model, probes, count, progress, by=by)


def set_recall(model: nn.Module, sinks: int = 0, sparse_cache: int = 0) -> list[int]:
    """Attention sinks and a LoLA-style sparse cache for every hybrid layer of a linearized ``model``, in place
    and training-free (no weight depends on them; ``save`` keeps them). The first ``sinks`` tokens, and per
    layer and kv head the ``sparse_cache`` keys the linear state recalls worst, are attended exactly;
    ``0, 0`` restores the plain hybrid. Returns the hybrid layer indices."""
    from .adapters.hybrid_attention import set_recall as set_layers_recall

    return set_layers_recall(model, sinks, sparse_cache)


def finetune_lora(model: nn.Module, blocks: torch.Tensor, config=None, progress: bool = True):
    """LoLCATs stage 2 alone on any model (e.g. the original, as the control of a linearization): LoRA on the
    attention projections with next-token loss on ``blocks`` [N, seq_len], merged; returns ``(model, report)``."""
    from .config import LinearizeConfig
    from .pipelines.lora import lora_finetune

    return lora_finetune(model, blocks, config or LinearizeConfig(), progress=progress)


def heal(model: nn.Module, teacher: nn.Module | None, blocks: torch.Tensor, config=None, progress: bool = True,
         work_dir=None, accelerator=None, on_step=None) -> tuple[nn.Module, dict]:
    """Distil ``teacher`` (the original model) into the converted ``model`` in place: LoRA on its projections
    (``LatentLinear`` factors, dense weights), KL between next-token distributions on ``blocks`` [N, seq_len],
    merged exactly (same layout and ranks). ``config`` is a ``HealConfig``; ``work_dir`` makes it resumable.
    Returns ``(model, report)``."""
    from .config import HealConfig
    from .pipelines.heal import heal_model

    return heal_model(model, teacher, blocks, config or HealConfig(), accelerator=accelerator, work_dir=work_dir,
                      progress=progress, on_step=on_step)


def load_tokenizer(name_or_path: str):
    """The tokenizer of a built-in alias, a local model directory or a hub id (no remote code)."""
    from .data.models import resolve_model_source

    try:
        source = resolve_model_source(name_or_path)
    except FileNotFoundError as error:
        raise ModelLoadError(str(error)) from None
    return _load_tokenizer(source, name_or_path)


def compress_out_of_core(name_or_path: str, out, config: CompressConfig, calibration: torch.Tensor, *, work_dir,
                         tokenizer=None, dtype="float32", device="cpu", metadata: dict | None = None,
                         overwrite: bool = False, progress: bool = True, parallel=None) -> tuple[nn.Module, dict]:
    """Compress a safetensors model (alias or local directory) into ``out`` one decoder layer at a time, for
    models larger than memory (pipelines/out_of_core.py); ``work_dir`` holds the finished layers (resumable).
    Returns ``(model, report)``, ``model`` on the meta device (structure only). ``parallel``: a
    ``pipelines.distributed.DataParallel`` (processes of a ``torchrun`` launch; rank 0 writes)."""
    from .data.models import resolve_model_source
    from .pipelines.distributed import SINGLE_PROCESS
    from .pipelines.out_of_core import compress_out_of_core as run

    return run(resolve_model_source(name_or_path), out, config, calibration, work_dir=work_dir,
               dtype=resolve_dtype(dtype), device=resolve_device(device), tokenizer=tokenizer, metadata=metadata,
               overwrite=overwrite, progress=progress, parallel=parallel or SINGLE_PROCESS)


def write_json(data: dict, path) -> Path:
    """Write a results dict atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=_json_default))
    tmp.replace(path)
    return path


def _json_default(obj):
    if isinstance(obj, (Path,)):
        return str(obj)
    if isinstance(obj, tuple):
        return list(obj)
    if isinstance(obj, torch.dtype):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def export(model: nn.Module, out, format: str = "hf", tokenizer=None, overwrite: bool = False, outtype: str = "f32",
           verify: bool = True, progress: bool = True, metadata: dict | None = None) -> dict:
    """Write ``model`` for another engine (docs/export.md): ``format="hf"``, a model converted to MLA as a plain
    transformers DeepSeek-V3 directory (checked against ``model``'s logits); ``"gguf"``, a llama.cpp GGUF file
    (``outtype`` f32 or bf16; builds llama.cpp on first use). Returns the export record."""
    from .pipelines.export import export_model

    return export_model(model, out, format, tokenizer=tokenizer, overwrite=overwrite, outtype=outtype, verify=verify,
                        progress=progress, metadata=metadata)
