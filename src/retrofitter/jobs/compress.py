"""``retrofitter compress``: calibrate, compress, (heal), save, evaluate; in memory or one layer at a time."""

from __future__ import annotations

import time
from pathlib import Path

from ..api import compress, compress_out_of_core, evaluate_record, load_tokenizer
from ..config import COMPRESS_CALIB_SAMPLES, CompressConfig, EvalConfig, HealConfig
from ..data.blocks import token_blocks
from ..data.corpora import check_corpus, load_text
from ..eval.accounting import account
from ..eval.perplexity import perplexity
from ..eval.resources import current_rss_mb, sampled_rss
from ..pipelines.sequential import CalibrationError
from ..preflight import eval_lengths, heal_dir, partial_dir
from .heal import add_heal_sections, heal_stages
from .scaffold import NO_EVAL, OutputJob, load_checked

__all__ = ["compress_job", "corpus_calibration_blocks", "CALIBRATION_CHARS_PER_TOKEN"]


def compress_job(model_name: str, out, config: CompressConfig, eval_config: EvalConfig = NO_EVAL, *,
                 calib: str = "wiki-calib", calib_samples: int = COMPRESS_CALIB_SAMPLES, seq_len: int = 512,
                 overwrite: bool = False, measure_cost: bool = False, dtype="float32", device="cpu",
                 progress: bool = True, heal_config: HealConfig | None = None, out_of_core: bool = False) -> dict:
    """Compress ``model_name`` on ``calib_samples`` blocks of ``seq_len`` tokens of ``calib``, save to ``out``
    (resumable through ``.OUT.partial`` beside it, removed once ``out`` is in place), evaluate; returns the
    results record. Every argument is checked before any work; one run at a time may write ``out``.
    ``heal_config`` (``--heal-tokens``): heal the compressed model (distillation from the original on
    ``calib``) before saving; the record then holds ``before`` (compressed) and ``original`` too.

    ``out_of_core``: the model is read one decoder layer at a time from its safetensors shards and never
    held whole (docs/scaling.md); the result is not evaluated (run ``retrofitter eval OUT``). Under
    ``torchrun`` the calibration is data-parallel over the processes (gloo on CPU, NCCL on CUDA) and
    rank 0 writes ``out``; the other processes return their own compression report."""
    out = Path(out)
    if calib_samples < 1:
        raise ValueError(f"--calib-samples must be >= 1, got {calib_samples}")
    if seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2 (a block needs a next token), got {seq_len}")
    check_corpus(calib, "--calib")
    if out_of_core and heal_config is not None:
        raise ValueError("--heal-tokens needs the model in memory; heal the --out-of-core result afterwards with "
                         "`retrofitter heal OUT`")
    work_dirs = {"the resume directory": partial_dir(out)}
    if heal_config is not None:
        work_dirs["the healing directory"] = heal_dir(out)
    job = OutputJob.start(out, overwrite, eval_config, {"MODEL": model_name, "--calib": calib}, work_dirs,
                          device=device, calibration_group=True)
    with job.writing():
        if out_of_core:
            return compress_out_of_core_job(job, model_name, config, calib, calib_samples, seq_len, overwrite,
                                            dtype, device, progress)
        return compress_in_memory(job, model_name, config, eval_config, calib, calib_samples, seq_len, overwrite,
                                  measure_cost, dtype, device, progress, heal_config)


def compress_in_memory(job: OutputJob, model_name, config, eval_config, calib, calib_samples, seq_len, overwrite,
                       measure_cost, dtype, device, progress, heal_config=None) -> dict:
    """``compress_job`` after its checks, the model in memory: the results record (rank 0)."""
    timings = {}
    # RSS before the model is loaded (interpreter, torch): the floor of the above-floor ratio; the model code
    # and the tokenizer transformers loads lazily (~175 MiB for SmolLM2) count above it
    floor_mb = current_rss_mb()
    start = time.perf_counter()
    model, tokenizer = load_checked(model_name, {"--seq-len": seq_len, **eval_lengths(eval_config)}, dtype=dtype,
                                    device=device)
    timings["load"] = time.perf_counter() - start
    calibration = corpus_calibration_blocks(tokenizer, calib, seq_len, calib_samples)
    before = account(model)
    memory = {"before_load": floor_mb, "after_load": current_rss_mb()}
    if measure_cost:  # one plain forward over the calibration tokens: the unit of the cost ratio
        t0 = time.perf_counter()
        perplexity(model, calibration, batch_size=config.batch_size, progress=False)
        timings["calibration_forward"] = time.perf_counter() - t0
        memory["after_calibration_forward"] = current_rss_mb()
    compress_memory: dict = {}
    parallel = job.parallel
    with sampled_rss(compress_memory, interval_s=0.05):  # the compression alone (not the --measure-cost forward)
        model, report = compress(model, config, calibration, progress=progress and job.writes,
                                 checkpoint_dir=partial_dir(job.out), remove_checkpoint=False, parallel=parallel)
    parallel.barrier()  # every process has saved its last layer before rank 0 removes the partial directory
    if not job.writes:
        return job.rank_report(compress_report=report)
    timings["compress"] = report["timings_s"]["total"]
    metadata = {"method": config.method, "ratio": config.ratio, "source_model": model_name,
                "config": config.to_dict(), "calibration": {"corpus": calib, "blocks": calibration.shape[0],
                                                            "seq_len": seq_len},
                "ranks": report["ranks"]}
    healing = None
    if heal_config is not None:
        healing = heal_stages(model, tokenizer, model_name, heal_config, eval_config, calib, job.out, progress,
                              dtype, device, name=model_name, method=config.method, ratio=config.ratio)
        model, metadata["heal"] = healing.model, healing.metadata
    t0 = time.perf_counter()
    job.save(model, tokenizer, metadata, overwrite)  # then the work directories: a failed save resumes from them
    timings["save"] = time.perf_counter() - t0
    record = evaluate_record(model, tokenizer, eval_config, progress=progress, name=model_name, method=config.method,
                             ratio=config.ratio, baseline=before)
    record.add_settings(calib=calib, calib_samples=calibration.shape[0], calib_seq_len=seq_len,
                        compress_config=config.to_dict())
    record.add_timings(**timings, compress_breakdown=report["timings_s"])
    fp32_mb = before.params_total * 4 / 2**20
    cost = {"peak_rss_over_fp32_model": compress_memory["peak_mb"] / fp32_mb, "fp32_model_mb": fp32_mb,
            "peak_rss_above_floor_over_fp32_model": (compress_memory["peak_mb"] - floor_mb) / fp32_mb,
            "rss_mb": {**memory, "after_capture": report["rss_after_capture_mb"],
                       "after_each_layer": [r["rss_mb"] for r in report["layers"]]},
            "statistics_spill_bytes": report.get("statistics_spill_bytes")}  # temporary disk, if any
    if measure_cost:
        cost["compress_over_calibration_forward"] = timings["compress"] / timings["calibration_forward"]
    record.add_sections(calibration=report["calibration"], compress_peak_rss_mb=compress_memory["peak_mb"], cost=cost,
                        allocation=report["allocation"], layers=report["layers"], processes=parallel.world_size)
    if healing is not None:
        add_heal_sections(record, healing)
    return job.results(record)


def compress_out_of_core_job(job: OutputJob, model_name, config, calib, calib_samples, seq_len, overwrite, dtype,
                             device, progress) -> dict:
    """``compress_job(..., out_of_core=True)`` after its checks: the results record (accounting, no perplexity).
    ``api.compress_out_of_core`` writes ``out`` itself (rank 0), one layer at a time."""
    start = time.perf_counter()
    tokenizer = load_tokenizer(model_name)
    calibration = corpus_calibration_blocks(tokenizer, calib, seq_len, calib_samples)
    metadata = {"method": config.method, "ratio": config.ratio, "source_model": model_name,
                "config": config.to_dict(), "out_of_core": True,
                "calibration": {"corpus": calib, "blocks": calibration.shape[0], "seq_len": seq_len}}
    memory: dict = {}
    with sampled_rss(memory, interval_s=0.05):
        model, report = compress_out_of_core(model_name, job.out, config, calibration, work_dir=partial_dir(job.out),
                                             tokenizer=tokenizer, dtype=dtype, device=device,
                                             metadata=metadata, overwrite=overwrite,
                                             progress=progress and job.writes, parallel=job.parallel)
    if not job.writes:
        return job.rank_report(compress_report=report)
    job.remove_work_dirs()
    record = evaluate_record(model, tokenizer, NO_EVAL, progress=False, name=model_name, method=config.method,
                             ratio=config.ratio)
    record.add_sections(out_of_core=True, processes=job.processes.world_size, calibration=report["calibration"],
                        compress_peak_rss_mb=memory["peak_mb"], allocation=report["allocation"],
                        layers=report["layers"])
    record.add_settings(calib=calib, calib_samples=calibration.shape[0], calib_seq_len=seq_len,
                        compress_config=config.to_dict())
    record.add_timings(total=time.perf_counter() - start, compress_breakdown=report["timings_s"])
    return job.results(record)


# characters of text tokenized per calibration token wanted (then the whole text if that was too little)
CALIBRATION_CHARS_PER_TOKEN = 16


def corpus_calibration_blocks(tokenizer, calib: str, seq_len: int, calib_samples: int):
    """The first ``calib_samples`` blocks of ``seq_len`` tokens of corpus ``calib`` [n, seq_len].

    Tokenizes a prefix of the text first (``CALIBRATION_CHARS_PER_TOKEN`` characters per token wanted): when
    it gives one block more than asked, the blocks kept end a whole block before the cut, so they are the
    blocks of the whole text, without the memory of tokenizing all of it; otherwise the whole text."""
    text = load_text(calib)
    prefix = text[:CALIBRATION_CHARS_PER_TOKEN * seq_len * (calib_samples + 1)]
    blocks = token_blocks(tokenizer, prefix, seq_len=seq_len, max_blocks=calib_samples + 1) if prefix else None
    if blocks is None or len(prefix) == len(text) or blocks.shape[0] <= calib_samples:
        blocks = token_blocks(tokenizer, text, seq_len=seq_len, max_blocks=calib_samples + 1)
    if blocks.shape[0] < calib_samples:
        raise CalibrationError(f"calibration corpus {calib!r} gives only {blocks.shape[0]} blocks of "
                               f"{seq_len} tokens; --calib-samples asks for {calib_samples}")
    return blocks[:calib_samples]
