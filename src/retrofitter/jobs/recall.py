"""``retrofitter recall``: recall beyond the window for an already linearized model, training-free.

Loads a linearized model (a ``linearize`` output), optionally gives softmax attention back to the
``keep_softmax_top`` layers ranked first ``keep_softmax_by`` recall gain or retrieval score
(``api.keep_softmax_for_recall``, probes hidden in ``probe_corpus``), sets ``sinks`` attention sinks and a ``sparse_cache`` of that many keys per layer and
kv head (``api.set_recall``), saves to ``out`` and evaluates. No weight changes.
"""

from __future__ import annotations

from pathlib import Path

from ..api import evaluate_record, keep_softmax_for_recall, recall_probes, set_recall
from ..checkpoint import conversion_metadata, is_retrofitted_dir, read_retrofitter_json
from ..config import EvalConfig
from ..data.corpora import check_corpus
from ..pipelines.recall_layers import RANKINGS
from ..preflight import eval_lengths
from .scaffold import NO_EVAL, OutputJob, load_checked

__all__ = ["recall_job"]


def recall_job(model_dir, out, *, sinks: int = 0, sparse_cache: int = 0, keep_softmax_top: int = 0,
               keep_softmax_by: str = "recall", probe_corpus: str = "wiki-calib", probe_tokens: int = 1024, probe_count: int = 4,
               eval_config: EvalConfig = NO_EVAL, overwrite: bool = False, dtype="float32", device="cpu",
               progress: bool = True) -> dict:
    """The steps of the module docstring; returns the results record (with ``recall`` settings and, when
    layers were kept, their recall ranking). Every argument is checked before any work."""
    out = Path(out)
    if not is_retrofitted_dir(model_dir) or "lolcats" not in str(read_retrofitter_json(model_dir).get("method", "")):
        raise ValueError(f"{model_dir} is not a linearized model (a `retrofitter linearize` output)")
    if sinks < 0 or sparse_cache < 0 or keep_softmax_top < 0:
        raise ValueError(f"--sinks, --sparse-cache and --keep-softmax-top must be >= 0; got {sinks}, {sparse_cache}, "
                         f"{keep_softmax_top}")
    if keep_softmax_by not in RANKINGS:
        raise ValueError(f"--keep-softmax-by must be one of {', '.join(RANKINGS)}; got {keep_softmax_by!r}")
    if keep_softmax_top:
        check_corpus(probe_corpus, "--probe-corpus")
        if probe_count < 1 or probe_tokens < 64:
            raise ValueError(f"--probe-count must be >= 1 and --probe-tokens >= 64; got {probe_count}, {probe_tokens}")
    job = OutputJob.start(out, overwrite, eval_config, {"MODEL": model_dir}, device=device).one_process("recall")
    with job.writing():
        lengths = {"--probe-tokens": probe_tokens} if keep_softmax_top else {}
        model, tokenizer = load_checked(model_dir, {**lengths, **eval_lengths(eval_config)}, dtype=dtype, device=device)
        report = {}
        if keep_softmax_top:
            probes = recall_probes(tokenizer, probe_corpus, count=probe_count, context_tokens=probe_tokens)
            report = keep_softmax_for_recall(model, probes, keep_softmax_top, progress=progress, by=keep_softmax_by)
        layers = set_recall(model, sinks, sparse_cache)
        metadata = conversion_metadata(model_dir)
        recall = {"sinks": sinks, "sparse_cache": sparse_cache, "hybrid_layers": layers,
                  "kept_softmax_layers": report.get("restored_softmax_layers", []), "source_dir": str(model_dir)}
        metadata["recall"] = recall
        job.save(model, tokenizer, metadata, overwrite)
        record = evaluate_record(model, tokenizer, eval_config, progress=progress, name=str(model_dir),
                                 method=metadata.get("method", "lolcats"), ratio=metadata.get("ratio"))
        record.add_sections(recall=recall)
        if report:
            record.add_sections(recall_ranking=report)
        return job.results(record)
