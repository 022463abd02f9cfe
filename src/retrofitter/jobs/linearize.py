"""``retrofitter linearize``: LoLCATs (attention transfer, then LoRA), saved and evaluated."""

from __future__ import annotations

import time
from pathlib import Path

from ..api import evaluate_record, linearize, load_model, recall_probes
from ..checkpoint import conversion_metadata, is_retrofitted_dir
from ..config import EvalConfig, LinearizeConfig
from ..data.blocks import token_blocks
from ..data.corpora import check_corpus, load_text
from ..eval.accounting import account
from ..eval.resources import peak_rss_mb
from ..pipelines.linearize import check_linearize_config
from ..preflight import checked_original, eval_lengths, original_model_of
from .scaffold import NO_EVAL, OutputJob, load_checked

__all__ = ["linearize_job"]


def linearize_job(model_name: str, out, config: LinearizeConfig, eval_config: EvalConfig = NO_EVAL, *,
                  preset: str | None = None, train_corpus: str = "wiki-calib", work_dir=None,
                  eval_original: bool = False, overwrite: bool = False, dtype="float32", device="cpu",
                  progress: bool = True) -> dict:
    """LoLCATs on ``model_name`` with text of ``train_corpus``, save to ``out``, evaluate; the results record.

    Transfer and LoRA read consecutive, disjoint blocks of the training text while it lasts. The
    block-wise transfer cache ``work_dir`` defaults to ``.OUT.transfer`` beside ``out`` (reused to resume,
    removed once ``out`` is in place). Every argument is checked before any work. Under ``torchrun`` rank 0
    writes ``out``; the other processes return their rank and linearization report.
    """
    out = Path(out)
    check_linearize_config(config)
    check_corpus(train_corpus, "--train-corpus")
    work_dir = Path(work_dir) if work_dir else out.parent / f".{out.name}.transfer"
    inputs = {"MODEL": model_name, "--train-corpus": train_corpus}
    if is_retrofitted_dir(model_name):
        inputs["its original model"] = checked_original(model_name)
    job = OutputJob.start(out, overwrite, eval_config, inputs, {"--work-dir": work_dir}, device=device)
    with job.writing():
        return linearize_and_save(job, model_name, config, eval_config, preset, train_corpus, work_dir, eval_original,
                                 overwrite, dtype, device, progress)


def linearize_and_save(job: OutputJob, model_name, config, eval_config, preset, train_corpus, work_dir: Path,
                      eval_original, overwrite, dtype, device, progress) -> dict:
    """``linearize_job`` after its checks, under the output lock: the results record (rank 0)."""
    timings, start = {}, time.perf_counter()
    ranks_on_probes = config.keep_softmax_top and config.keep_softmax_by != "mse"
    lengths = {"--seq-len": config.seq_len, **({"--probe-tokens": config.probe_tokens or config.seq_len} if ranks_on_probes else {})}
    model, tokenizer = load_checked(model_name, {**lengths, **eval_lengths(eval_config)}, dtype=dtype, device=device)
    timings["load"] = time.perf_counter() - start
    before = account(model)
    original = None
    if eval_original:
        original = evaluate_record(model, tokenizer, eval_config, progress=progress, name=model_name)
    wanted = config.transfer_tokens + config.lora_tokens
    blocks = token_blocks(tokenizer, load_text(train_corpus), config.seq_len, max_tokens=max(wanted, config.seq_len))
    n_transfer = max(1, config.transfer_tokens // config.seq_len)
    n_lora = max(1, config.lora_tokens // config.seq_len)
    transfer_blocks = blocks[:n_transfer]
    lora_blocks = blocks[n_transfer:n_transfer + n_lora] if blocks.shape[0] >= n_transfer + n_lora else blocks[:n_lora]
    original_name, teacher = model_name, None
    if is_retrofitted_dir(model_name):  # a conversion (e.g. compressed): stage 2 distils from its original
        original_name = original_model_of(model_name)
        if config.lora_tokens > 0 and config.lora_loss == "kl":
            teacher, _ = load_model(original_name, dtype=dtype, device=device)
    probes = None
    if ranks_on_probes:  # probes hidden in the training text
        probes = recall_probes(tokenizer, train_corpus, context_tokens=config.probe_tokens or config.seq_len)
    model, report = linearize(model, config, transfer_blocks, lora_blocks, progress=progress, work_dir=work_dir,
                              teacher=teacher, recall_probes=probes)
    del teacher
    if not job.writes:
        return job.rank_report(linearize_report=report)
    timings.update(report["timings_s"])
    linearize_peak = peak_rss_mb()
    metadata = {"method": "lolcats", "ratio": None, "source_model": model_name, "config": config.to_dict(),
                "preset": preset, "kept_softmax_layers": report["kept_softmax_layers"],
                "replaced_layers": sorted(set(report["replaced_layers"]) - set(report["kept_softmax_layers"]))}
    if original_name != model_name:  # linearized on top of another conversion
        base = conversion_metadata(model_name)
        metadata.update(original_model=original_name, method=f"{base.get('method', 'retrofitted')}+lolcats",
                        ratio=base.get("ratio"), base_conversion=base)
    t0 = time.perf_counter()
    # the cached teacher inputs of block-wise transfer go once the model is saved (only what was written)
    job.save(model, tokenizer, metadata, overwrite, remove=[work_dir] if config.transfer_mode == "blockwise" else [])
    timings["save"] = time.perf_counter() - t0
    record = evaluate_record(model, tokenizer, eval_config, progress=progress, name=model_name,
                             method=metadata["method"], ratio=metadata["ratio"], baseline=before)
    record.add_settings(linearize_config=config.to_dict(), preset=preset, train_corpus=train_corpus,
                        transfer_blocks=list(transfer_blocks.shape), lora_blocks=list(lora_blocks.shape),
                        work_dir=str(work_dir))
    record.add_timings(**timings)
    record.add_sections(linearize_peak_rss_mb=linearize_peak,
                        transfer_mse={str(k): v for k, v in report.get("transfer", {}).get("layers", {}).items()},
                        lora={k: v for k, v in report.get("lora", {}).items() if k != "loss_history"})
    if "recall_ranking" in report:  # the kept softmax layers' ranking (keep_softmax_by other than mse)
        record.add_sections(recall_ranking=report["recall_ranking"])
    if original is not None:
        record.add_sections(ppl_original=original.ppl, original=original)
    return job.results(record)
