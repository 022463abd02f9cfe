"""The CLI's jobs as functions: load → convert → save → evaluate, each returning the results record.

``retrofitter compress|linearize|eval`` map their flags onto these arguments and print/write what
they return; a script can call them the same way. The record itself is built by ``api.evaluate``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path


from .api import (compress, compress_out_of_core, convert_to_mla, evaluate, evaluation_blocks, export, heal, linearize,
                  load_model, load_tokenizer, recall_probes, save)
from .checkpoint import (RETROFITTER_JSON, check_separate_paths, conversion_metadata, is_retrofitted_dir, output_lock,
                         read_retrofitter_json)
from .config import COMPRESS_CALIB_SAMPLES, MLA_CALIB_SAMPLES, CompressConfig, EvalConfig, HealConfig, LinearizeConfig
from .data.blocks import token_blocks
from .data.corpora import check_corpus, load_text
from .eval.accounting import account
from .eval.perplexity import perplexity
from .eval.resources import current_rss_mb, peak_rss_mb, sampled_rss
from .pipelines.distributed import SINGLE_PROCESS, data_parallel_from_env
from .pipelines.linearize import check_linearize_config
from .pipelines.resume import remove_work_dir
from .pipelines.sequential import CalibrationError
from .preflight import (check_context, check_outputs, check_teacher, checked_original, eval_lengths, heal_dir,
                        original_model_of, partial_dir)

__all__ = ["compress_job", "mla_job", "linearize_job", "eval_job", "heal_job", "original_model_of", "NO_EVAL"]

NO_EVAL = EvalConfig(corpora=())  # accounting only, no perplexity


def torchrun_rank() -> int:
    """This process's rank in a ``torchrun`` launch (0 outside one): the stages that accelerate runs (heal,
    linearize) read it from the environment; compress initialises its own group (data_parallel_from_env)."""
    return int(os.environ.get("RANK", "0"))


def compress_job(model_name: str, out, config: CompressConfig, eval_config: EvalConfig = NO_EVAL, *,
                 calib: str = "wiki-calib", calib_samples: int = COMPRESS_CALIB_SAMPLES, seq_len: int = 512, overwrite: bool = False,
                 measure_cost: bool = False, dtype="float32", device="cpu", progress: bool = True,
                 heal_config: HealConfig | None = None, out_of_core: bool = False) -> dict:
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
    work_dirs = {"the resume directory": partial_dir(out)}
    if heal_config is not None:
        work_dirs["the healing directory"] = heal_dir(out)
    check_outputs(out, overwrite, eval_config, {"MODEL": model_name, "--calib": calib}, work_dirs)
    if out_of_core and heal_config is not None:
        raise ValueError("--heal-tokens needs the model in memory; heal the --out-of-core result afterwards with "
                         "`retrofitter heal OUT`")
    parallel = data_parallel_from_env(device)
    with output_lock(out) if parallel.rank == 0 else contextlib.nullcontext():
        if out_of_core:
            return compress_out_of_core_job(model_name, out, config, calib, calib_samples, seq_len, overwrite,
                                            dtype, device, progress, parallel)
        return _compress(model_name, out, config, eval_config, calib, calib_samples, seq_len, overwrite,
                         measure_cost, dtype, device, progress, heal_config, parallel)


def _compress(model_name, out: Path, config, eval_config, calib, calib_samples, seq_len, overwrite, measure_cost,
              dtype, device, progress, heal_config=None, parallel=SINGLE_PROCESS) -> dict:
    timings = {}
    # RSS before the model is loaded (interpreter, torch): the floor of the above-floor ratio; the model code
    # and the tokenizer transformers loads lazily (~175 MiB for SmolLM2) count above it
    floor_mb = current_rss_mb()
    start = time.perf_counter()
    model, tokenizer = load_model(model_name, dtype=dtype, device=device)
    timings["load"] = time.perf_counter() - start
    check_context(model, {"--seq-len": seq_len, **eval_lengths(eval_config)})
    calibration = corpus_calibration_blocks(tokenizer, calib, seq_len, calib_samples)
    before = account(model)
    memory = {"before_load": floor_mb, "after_load": current_rss_mb()}
    if measure_cost:  # one plain forward over the calibration tokens: the unit of the cost ratio
        t0 = time.perf_counter()
        perplexity(model, calibration, batch_size=config.batch_size, progress=False)
        timings["calibration_forward"] = time.perf_counter() - t0
        memory["after_calibration_forward"] = current_rss_mb()
    compress_memory: dict = {}
    partial = partial_dir(out)
    with sampled_rss(compress_memory, interval_s=0.05):  # the compression alone (not the --measure-cost forward)
        model, report = compress(model, config, calibration, progress=progress and parallel.rank == 0,
                                 checkpoint_dir=partial, remove_checkpoint=False, parallel=parallel)
    parallel.barrier()  # every process has saved its last layer before rank 0 removes the partial directory
    if parallel.rank != 0:
        return {"rank": parallel.rank, "processes": parallel.world_size, "compress_report": report}
    timings["compress"] = report["timings_s"]["total"]
    metadata = {"method": config.method, "ratio": config.ratio, "source_model": model_name,
                "config": config.to_dict(), "calibration": {"corpus": calib, "blocks": calibration.shape[0],
                                                            "seq_len": seq_len},
                "ranks": report["ranks"]}
    healing = None
    if heal_config is not None:
        healing = _heal_stages(model, tokenizer, model_name, heal_config, eval_config, calib, out, progress,
                               dtype, device, name=model_name, method=config.method, ratio=config.ratio)
        model, metadata["heal"] = healing["model"], healing["metadata"]
    t0 = time.perf_counter()
    save(model, out, tokenizer=tokenizer, metadata=metadata, overwrite=overwrite)
    remove_work_dir(partial)  # only now: a failed save leaves the finished layers to resume from
    if healing is not None:
        remove_work_dir(healing["work_dir"])
    timings["save"] = time.perf_counter() - t0
    results = evaluate(model, tokenizer, eval_config, progress=progress, name=model_name, method=config.method,
                       ratio=config.ratio, baseline=before)
    results["calibration"] = report["calibration"]
    results["out"] = str(out)
    results["settings"].update({"calib": calib, "calib_samples": calibration.shape[0], "calib_seq_len": seq_len,
                                "compress_config": config.to_dict()})
    results["timings_s"].update(timings, compress_breakdown=report["timings_s"])
    fp32_mb = before.params_total * 4 / 2**20
    results["compress_peak_rss_mb"] = compress_memory["peak_mb"]
    results["cost"] = {"peak_rss_over_fp32_model": compress_memory["peak_mb"] / fp32_mb, "fp32_model_mb": fp32_mb,
                       "peak_rss_above_floor_over_fp32_model": (compress_memory["peak_mb"] - floor_mb) / fp32_mb,
                       "rss_mb": {**memory, "after_capture": report["rss_after_capture_mb"],
                                  "after_each_layer": [r["rss_mb"] for r in report["layers"]]}}
    results["cost"]["statistics_spill_bytes"] = report.get("statistics_spill_bytes")  # temporary disk, if any
    if measure_cost:
        results["cost"]["compress_over_calibration_forward"] = timings["compress"] / timings["calibration_forward"]
    results["allocation"] = report["allocation"]
    results["layers"] = report["layers"]
    if healing is not None:
        _add_heal_sections(results, healing)
    results["processes"] = parallel.world_size
    return results


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


def compress_out_of_core_job(model_name, out: Path, config, calib, calib_samples, seq_len, overwrite, dtype, device,
                             progress, parallel=SINGLE_PROCESS) -> dict:
    """``compress_job(..., out_of_core=True)`` after its checks: the results record (accounting, no perplexity)."""
    start = time.perf_counter()
    tokenizer = load_tokenizer(model_name)
    calibration = corpus_calibration_blocks(tokenizer, calib, seq_len, calib_samples)
    partial = partial_dir(out)
    metadata = {"method": config.method, "ratio": config.ratio, "source_model": model_name,
                "config": config.to_dict(), "out_of_core": True,
                "calibration": {"corpus": calib, "blocks": calibration.shape[0], "seq_len": seq_len}}
    memory: dict = {}
    with sampled_rss(memory, interval_s=0.05):
        model, report = compress_out_of_core(model_name, out, config, calibration, work_dir=partial,
                                             tokenizer=tokenizer, dtype=dtype, device=device,
                                             metadata=metadata, overwrite=overwrite,
                                             progress=progress and parallel.rank == 0, parallel=parallel)
    if parallel.rank != 0:
        return {"rank": parallel.rank, "processes": parallel.world_size, "compress_report": report}
    remove_work_dir(partial)
    results = evaluate(model, tokenizer, NO_EVAL, progress=False, name=model_name, method=config.method,
                       ratio=config.ratio)
    results.update(out=str(out), out_of_core=True, processes=parallel.world_size, calibration=report["calibration"],
                   compress_peak_rss_mb=memory["peak_mb"], allocation=report["allocation"], layers=report["layers"])
    results["settings"].update({"calib": calib, "calib_samples": calibration.shape[0], "calib_seq_len": seq_len,
                                "compress_config": config.to_dict()})
    results["timings_s"].update(total=time.perf_counter() - start, compress_breakdown=report["timings_s"])
    return results


def mla_job(model_name: str, out, config, eval_config: EvalConfig = NO_EVAL, *, calib: str = "wiki-calib",
            calib_samples: int = MLA_CALIB_SAMPLES, seq_len: int = 512, overwrite: bool = False, dtype="float32", device="cpu",
            progress: bool = True) -> dict:
    """Convert ``model_name``'s attention to MLA (``config``: a ``pipelines.mla.MLAConfig``) on ``calib_samples``
    blocks of ``seq_len`` tokens of ``calib``, save to ``out``, evaluate; the results record. Every argument is
    checked before any work; one run at a time may write ``out``."""
    out = Path(out)
    if calib_samples < 1:
        raise ValueError(f"--calib-samples must be >= 1, got {calib_samples}")
    check_corpus(calib, "--calib")
    check_outputs(out, overwrite, eval_config, {"MODEL": model_name, "--calib": calib}, {})
    with output_lock(out):
        start = time.perf_counter()
        model, tokenizer = load_model(model_name, dtype=dtype, device=device)
        check_context(model, {"--seq-len": seq_len, **eval_lengths(eval_config)})
        before = account(model)
        calibration = corpus_calibration_blocks(tokenizer, calib, seq_len, calib_samples)
        model, report = convert_to_mla(model, config, calibration, progress=progress)
        metadata = {"method": "mla", "ratio": None, "source_model": model_name, "config": config.to_dict(),
                    "calibration": {"corpus": calib, "blocks": calibration.shape[0], "seq_len": seq_len},
                    "kv_rank": report["kv_rank"], "rope_dim": report["rope_dim"]}
        save(model, out, tokenizer=tokenizer, metadata=metadata, overwrite=overwrite)
        results = evaluate(model, tokenizer, eval_config, progress=progress, name=model_name, method="mla",
                           ratio=None, baseline=before)
        results.update(out=str(out), mla={k: v for k, v in report.items() if k != "layers"}, layers=report["layers"])
        results["settings"].update({"calib": calib, "calib_samples": calibration.shape[0], "calib_seq_len": seq_len,
                                    "mla_config": config.to_dict()})
        results["timings_s"].update(total=time.perf_counter() - start, convert=report["timings_s"]["total"])
        return results


def export_job(model_name: str, out, fmt: str, *, outtype: str = "f32", overwrite: bool = False,
               verify: bool = True, progress: bool = True) -> dict:
    """Load ``model_name`` (a retrofitter output or any model) and export it (``api.export``); one run at a time
    may write ``out``, which may not be the input."""
    check_separate_paths({"--out": out}, {"MODEL": model_name})
    with output_lock(out):
        model, tokenizer = load_model(model_name, dtype="float32")
        metadata = {"source_model": str(model_name)}
        if is_retrofitted_dir(model_name):
            info = read_retrofitter_json(model_name)
            metadata.update(method=info.get("method"), original_model=info.get("source_model"))
        return export(model, out, fmt, tokenizer=tokenizer, overwrite=overwrite, outtype=outtype, verify=verify,
                      progress=progress, metadata=metadata)


def linearize_job(model_name: str, out, config: LinearizeConfig, eval_config: EvalConfig = NO_EVAL, *,
                  preset: str | None = None, train_corpus: str = "wiki-calib", work_dir=None,
                  eval_original: bool = False, overwrite: bool = False, dtype="float32", device="cpu",
                  progress: bool = True) -> dict:
    """LoLCATs on ``model_name`` with text of ``train_corpus``, save to ``out``, evaluate; the results record.

    Transfer and LoRA read consecutive, disjoint blocks of the training text while it lasts. The
    block-wise transfer cache ``work_dir`` defaults to ``.OUT.transfer`` beside ``out`` (reused to resume,
    removed once ``out`` is in place). Every argument is checked before any work.
    """
    out = Path(out)
    check_linearize_config(config)
    check_corpus(train_corpus, "--train-corpus")
    work_dir = Path(work_dir) if work_dir else out.parent / f".{out.name}.transfer"
    inputs = {"MODEL": model_name, "--train-corpus": train_corpus}
    if is_retrofitted_dir(model_name):
        inputs["its original model"] = checked_original(model_name)
    check_outputs(out, overwrite, eval_config, inputs, {"--work-dir": work_dir})
    with output_lock(out) if torchrun_rank() == 0 else contextlib.nullcontext():  # rank 0 writes
        return _linearize(model_name, out, config, eval_config, preset, train_corpus, work_dir, eval_original,
                          overwrite, dtype, device, progress)


def _linearize(model_name, out: Path, config, eval_config, preset, train_corpus, work_dir, eval_original, overwrite,
               dtype, device, progress) -> dict:
    timings, start = {}, time.perf_counter()
    model, tokenizer = load_model(model_name, dtype=dtype, device=device)
    timings["load"] = time.perf_counter() - start
    check_context(model, {"--seq-len": config.seq_len, **eval_lengths(eval_config)})
    before = account(model)
    original = evaluate(model, tokenizer, eval_config, progress=progress, name=model_name) if eval_original else None
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
    if config.keep_softmax_top and config.keep_softmax_by == "recall":  # probes hidden in the training text
        probes = recall_probes(tokenizer, train_corpus, context_tokens=config.seq_len)
    model, report = linearize(model, config, transfer_blocks, lora_blocks, progress=progress, work_dir=work_dir,
                              teacher=teacher, recall_probes=probes)
    del teacher
    if torchrun_rank() != 0:
        return {"rank": torchrun_rank(), "linearize_report": report}
    timings.update(report["timings_s"])
    linearize_peak = peak_rss_mb()
    metadata = {"method": "lolcats", "ratio": None, "source_model": model_name, "config": config.to_dict(),
                "preset": preset, "replaced_layers": report["replaced_layers"]}
    if original_name != model_name:  # linearized on top of another conversion
        base = conversion_metadata(model_name)
        metadata.update(original_model=original_name, method=f"{base.get('method', 'retrofitted')}+lolcats",
                        ratio=base.get("ratio"), base_conversion=base)
    t0 = time.perf_counter()
    save(model, out, tokenizer=tokenizer, metadata=metadata, overwrite=overwrite)
    if config.transfer_mode == "blockwise":
        remove_work_dir(work_dir)  # the cached teacher inputs, once the model is saved (only what was written)
    timings["save"] = time.perf_counter() - t0
    results = evaluate(model, tokenizer, eval_config, progress=progress, name=model_name, method=metadata["method"],
                       ratio=metadata["ratio"], baseline=before)
    results["out"] = str(out)
    results["settings"].update({"linearize_config": config.to_dict(), "preset": preset, "train_corpus": train_corpus,
                                "transfer_blocks": list(transfer_blocks.shape), "lora_blocks": list(lora_blocks.shape),
                                "work_dir": str(work_dir)})
    results["timings_s"].update(timings)
    results["linearize_peak_rss_mb"] = linearize_peak
    if original is not None:
        results["ppl_original"] = original["ppl"]
        results["original"] = original
    results["transfer_mse"] = {str(k): v for k, v in report.get("transfer", {}).get("layers", {}).items()}
    results["lora"] = {k: v for k, v in report.get("lora", {}).items() if k != "loss_history"}
    return results


def eval_job(model_name: str, eval_config: EvalConfig, *, tasks=(), tasks_limit: float | None = None,
             passkey=(), passkey_trials: int = 2, passkey_depths=(0.1, 0.5, 0.9), passkey_keys: int = 1,
             dtype="float32", device="cpu", quantize: str | None = None, progress: bool = True) -> dict:
    """Perplexity and accounting of any causal LM (and lm-eval ``tasks``, passkey retrieval at the ``passkey``
    prompt lengths when given: ``passkey_trials`` random keys per length and depth; ``passkey_keys`` K > 1 adds
    the multi-key variant, K needles with one asked, as ``results["multikey"]``); the results record.

    ``quantize`` (a scheme of ``api.QUANTIZE_SCHEMES``) quantizes the model after loading."""
    for corpus in eval_config.corpora:
        check_corpus(corpus, "--ppl")
    if passkey_trials < 1:
        raise ValueError(f"--passkey-trials must be >= 1, got {passkey_trials}")
    if not 1 <= passkey_keys <= 8:
        raise ValueError(f"--passkey-keys must lie in 1..8, got {passkey_keys}")
    if any(not 0.0 <= d <= 1.0 for d in passkey_depths) or not passkey_depths:
        raise ValueError(f"--passkey-depths must be fractions in [0, 1], got {list(passkey_depths)}")
    if tasks:
        from .eval.lm_eval_harness import lm_eval_available

        if not lm_eval_available():  # fail before the (slow) perplexity evaluation
            raise ValueError("--tasks needs lm-eval: pip install 'retrofitter[lm-eval]'")
    model, tokenizer = load_model(model_name, dtype=dtype, device=device, quantize=quantize)
    method, ratio = "original", None
    if is_retrofitted_dir(model_name):
        info = json.loads((Path(model_name) / RETROFITTER_JSON).read_text())
        method, ratio = info.get("method", "retrofitted"), info.get("ratio")
    check_context(model, {**eval_lengths(eval_config, "--seq-len"), "--passkey": max(passkey, default=0)})
    results = evaluate(model, tokenizer, eval_config, progress=progress, name=model_name, method=method, ratio=ratio)
    if passkey:
        from .eval.passkey import passkey_accuracy

        settings = dict(context_lengths=tuple(passkey), depths=tuple(passkey_depths), trials=passkey_trials,
                        progress=progress)
        results["passkey"] = passkey_accuracy(model, tokenizer, **settings)
        if passkey_keys > 1:
            results["multikey"] = passkey_accuracy(model, tokenizer, keys=passkey_keys, seed=1, **settings)
    if tasks:
        from .eval.lm_eval_harness import run_lm_eval

        limit = tasks_limit if tasks_limit is None or tasks_limit < 1 else int(tasks_limit)
        results["lm_eval"] = run_lm_eval(model, tokenizer, list(tasks), limit=limit)
    return results


def heal_job(model_dir, out, config: HealConfig, eval_config: EvalConfig = NO_EVAL, *, teacher: str | None = None,
             train_corpus: str = "wiki-calib", control: bool = False, overwrite: bool = False, dtype="float32",
             device="cpu", progress: bool = True) -> dict:
    """Heal the saved conversion ``model_dir`` by distillation from its original (``teacher``, default: the
    ``source_model`` it was made from) on ``train_corpus``; save to ``out``; the results record with ``before``
    (the conversion), ``original`` and, with ``control``, the original given the same distillation (≈ 1.0x).
    Resumable through ``.OUT.heal`` beside ``out`` (removed once ``out`` is in place)."""
    out = Path(out)
    if not is_retrofitted_dir(model_dir):
        raise ValueError(f"{model_dir} is not a saved retrofitter model (no {RETROFITTER_JSON}); heal takes the output "
                         f"of compress or linearize")
    given = teacher is not None
    teacher = teacher or checked_original(model_dir)
    check_teacher(model_dir, teacher, f"--teacher {teacher}" if given else f"the source_model {teacher}")
    check_corpus(train_corpus, "--train-corpus")
    check_outputs(out, overwrite, eval_config, {"MODEL": model_dir, "--teacher": teacher,
                                                 "--train-corpus": train_corpus},
                   {"the healing directory": heal_dir(out)})
    rank = torchrun_rank()
    with output_lock(out) if rank == 0 else contextlib.nullcontext():  # under torchrun, rank 0 writes
        info = conversion_metadata(model_dir)
        model, tokenizer = load_model(str(model_dir), dtype=dtype, device=device)
        check_context(model, {"--seq-len": config.seq_len, **eval_lengths(eval_config)})
        method = info.get("method", "retrofitted")
        healing = _heal_stages(model, tokenizer, teacher, config, eval_config, train_corpus, out, progress, dtype, device,
                               name=str(model_dir), method=method, ratio=info.get("ratio"), control=control)
        if rank != 0:
            return {"rank": rank, "heal": healing["metadata"]}
        metadata = {**info, "heal": healing["metadata"]}
        save(healing["model"], out, tokenizer=tokenizer, metadata=metadata, overwrite=overwrite)
        remove_work_dir(healing["work_dir"])
        results = evaluate(healing["model"], tokenizer, eval_config, progress=progress, blocks=healing["eval_blocks"],
                           name=str(model_dir), method=f"{method}+heal", ratio=info.get("ratio"),
                           baseline=healing["baseline"])
        results["out"] = str(out)
        results["settings"].update({"heal_config": config.to_dict(), "teacher": teacher, "train_corpus": train_corpus})
        _add_heal_sections(results, healing)
        return results


def _heal_stages(model, tokenizer, teacher_name, config: HealConfig, eval_config, train_corpus, out: Path, progress,
                 dtype, device, *, name, method, ratio, control: bool = False) -> dict:
    """Evaluate the original and the conversion, heal (work dir ``.OUT.heal``), and the control when asked."""
    teacher, _ = load_model(teacher_name, dtype=dtype, device=device)
    eval_blocks = {c: evaluation_blocks(tokenizer, c, eval_config.seq_len, eval_config.max_eval_tokens)
                   for c in eval_config.corpora}
    baseline = account(teacher)
    original = evaluate(teacher, tokenizer, eval_config, progress=progress, blocks=eval_blocks, name=teacher_name)
    before = evaluate(model, tokenizer, eval_config, progress=progress, blocks=eval_blocks, name=name, method=method,
                      ratio=ratio, baseline=baseline)
    max_tokens = config.tokens if config.tokens and not config.minutes else None  # a time budget may loop the text
    blocks = token_blocks(tokenizer, load_text(train_corpus), config.seq_len,
                          max_tokens=max(max_tokens, config.seq_len) if max_tokens else None)
    work_dir = heal_dir(out)
    model, report = heal(model, teacher, blocks, config, progress=progress, work_dir=work_dir)
    stages = {"model": model, "work_dir": work_dir, "eval_blocks": eval_blocks, "baseline": baseline,
              "original": original, "before": before, "report": report,
              "metadata": {"teacher": teacher_name, "train_corpus": train_corpus, "config": config.to_dict(),
                           "steps": report["steps"], "tokens": report["tokens"], "seconds": report["seconds"]}}
    if control and report["steps"]:
        # The original given the same distillation (the tokens the heal used, no time budget): ≈ 1.0x by construction.
        student, _ = load_model(teacher_name, dtype=dtype, device=device)
        same = dataclasses.replace(config, tokens=report["tokens"], minutes=0.0)
        student, control_report = heal(student, teacher, blocks, same, progress=progress)
        stages["control"] = evaluate(student, tokenizer, eval_config, progress=progress, blocks=eval_blocks,
                                     name=teacher_name, method="original+heal")
        stages["control"]["heal"] = {k: v for k, v in control_report.items() if k != "loss_history"}
    return stages


def _add_heal_sections(results: dict, healing: dict) -> None:
    """``original``, ``before``, ``control`` records, the heal report and ``ppl_over_original`` per stage."""
    results["original"], results["before"], results["heal"] = healing["original"], healing["before"], healing["report"]
    stages = {"before": healing["before"], "after": results}
    if "control" in healing:
        results["control"] = stages["control"] = healing["control"]
    reference = healing["original"]["ppl"]
    results["ppl_over_original"] = {stage: {c: record["ppl"][c] / reference[c] for c in reference}
                                    for stage, record in stages.items()}
