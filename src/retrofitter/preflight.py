"""Checks every job makes before any work: outputs that may be written and replaced, inputs no output may
touch, work directories that are retrofitter's own, sequence lengths the model was trained for, a teacher
that fits the student, the memory an ``mla`` run's calibration stream takes. Each failure is one line naming
the flag or file (docs/failure-modes.md)."""

from __future__ import annotations

import logging
from pathlib import Path

from .adapters.registry import adapter_for
from .checkpoint import (RETROFITTER_JSON, check_separate_paths, check_writable, is_retrofitted_dir,
                         prepare_output_dir, read_retrofitter_json)
from .config import EvalConfig
from .data.corpora import check_corpus
from .data.models import check_model_name, resolve_model_source
from .eval.resources import available_memory_bytes
from .pipelines.mla_transfer import carries_original_stream
from .pipelines.resume import check_work_dir

__all__ = ["partial_dir", "heal_dir", "check_outputs", "check_context", "eval_lengths", "check_teacher",
           "checked_original", "original_model_of", "mla_stream_copies", "check_mla_memory"]

log = logging.getLogger(__name__)


def partial_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.partial"


def heal_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.heal"


def check_outputs(out: Path, overwrite: bool, eval_config: EvalConfig, inputs: dict, work_dirs: dict) -> None:
    """Before any work: the output may be written (and, with ``overwrite``, replaced: only a previous
    retrofitter output or an empty directory), the evaluation corpora exist, no output or work directory
    (``work_dirs``: what -> path) is, contains or lies inside an input (``inputs``: flag -> path), and each work
    directory is new, empty or retrofitter's own."""
    replaced = prepare_output_dir(out, overwrite)
    check_writable(out, "--out")
    for corpus in eval_config.corpora:
        check_corpus(corpus, "--eval")
        inputs = {**inputs, f"--eval {corpus}": corpus}
    check_separate_paths({"--out": out, **work_dirs}, inputs)
    for what, path in work_dirs.items():
        check_work_dir(path, what)
    if replaced:
        log.warning("--overwrite: %s will be replaced once the new output is complete", replaced)


def check_context(model, lengths: dict) -> None:
    """Refuse (naming the flag) a sequence length beyond the model's ``max_position_embeddings``: positions
    past it were never trained, so every figure measured there would mislead. ``lengths``: flag -> tokens."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(config, "max_position_embeddings", None)
    for flag, tokens in lengths.items():
        if limit and tokens and tokens > limit:
            raise ValueError(f"{flag} {tokens} exceeds the model's max_position_embeddings ({limit}): positions "
                             f"beyond it were never trained; use at most {limit}")


def mla_stream_copies(config) -> int:
    """Copies of the calibration stream [n, T, d] that ``retrofitter mla`` holds at a layer's peak
    (docs/scaling.md): without a transfer the stream entering the layer and the one leaving it; with one the stream,
    the original model's h_T (for the ``teacher`` and ``residual`` targets or an MLP transfer), the layer's inputs
    and targets, and with ``--transfer-kl`` and the original's targets its inputs as well."""
    if not config.transfer_epochs:
        return 2
    return 1 + carries_original_stream(config) + 2 + (config.transfer_kl > 0 and config.transfer_target != "converted")


def check_mla_memory(config, model, calibration) -> None:
    """Refuse, before any work, an ``mla`` run whose calibration activations alone (``mla_stream_copies`` copies of
    n·T·d numbers in the model's dtype) exceed the memory free on the model's device."""
    weight = next(model.parameters())
    copy = calibration.numel() * adapter_for(model).text_config(model).hidden_size * weight.element_size()
    need, free = mla_stream_copies(config) * copy, available_memory_bytes(weight.device)
    if need > free:
        raise ValueError(f"--calib-samples {calibration.shape[0]} of {calibration.shape[1]} tokens: mla would hold "
                         f"{mla_stream_copies(config)} copies of the calibration stream, {need / 2**30:.2f} GiB, and "
                         f"{weight.device} has {free / 2**30:.2f} GiB free (docs/scaling.md); lower --calib-samples")


def eval_lengths(eval_config: EvalConfig, flag: str = "--eval-seq-len") -> dict:
    return {flag: eval_config.seq_len} if eval_config.corpora else {}


def check_teacher(model_dir, teacher: str, what: str) -> None:
    """Before any work: the teacher shares the student's vocabulary (the distillation compares their logits
    token by token) and architecture (heal distils from the model's own original)."""
    import transformers

    def text_config(name):
        config = transformers.AutoConfig.from_pretrained(resolve_model_source(name), trust_remote_code=False)
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    try:
        student, original = text_config(model_dir), text_config(teacher)
    except (OSError, ValueError):  # an unreadable config: the model load reports it with its own message
        return
    if student.vocab_size != original.vocab_size:
        raise ValueError(f"{what} has a vocabulary of {original.vocab_size} tokens, the model {model_dir} one of "
                         f"{student.vocab_size}: distillation compares their logits token by token; give the "
                         f"model's original as --teacher")
    if student.model_type != original.model_type:
        raise ValueError(f"{what} is a {original.model_type} model, but {model_dir} was converted from a "
                         f"{student.model_type} model: heal distils from the model's own original; give it as "
                         f"--teacher (or leave --teacher out)")


def checked_original(model_dir) -> str:
    """``original_model_of(model_dir)``, refused at once when it names a local path that is not there."""
    original = original_model_of(model_dir)
    try:
        check_model_name(original)
    except FileNotFoundError as error:
        raise ValueError(f"{Path(model_dir) / RETROFITTER_JSON} names source_model {original}, which is not there "
                         f"({error}); pass --teacher") from None
    return original


def original_model_of(model_dir) -> str:
    """The original model a saved conversion came from: ``source_model`` of its retrofitter.json, followed
    through conversions of conversions (``linearize`` run on a compressed directory)."""
    name, seen = str(model_dir), set()
    while is_retrofitted_dir(name):
        if name in seen:
            raise ValueError(f"{model_dir}: the source_model entries of retrofitter.json form a loop; pass --teacher")
        seen.add(name)
        info = read_retrofitter_json(name)
        source = info.get("original_model") or info.get("source_model")
        if not source:
            raise ValueError(f"{name}: retrofitter.json names no source_model; pass --teacher")
        name = str(source)
    return name
