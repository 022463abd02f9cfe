"""``retrofitter demo``: the main job on the default model, end to end, in one command.

fetch → evaluate the original → asvd-rootcov at every ratio (one shared calibration-statistics pass
of the original model, ``statistics="teacher"``, so extra ratios cost only a factorization), with
uniform ranks and with global fisher allocation (``rootcov-global-fisher``: the default of
``retrofitter compress``) →
latentllm at ``latentllm_ratios`` (its own sequential pipeline) → MLA attention at ``mla_kv_ratios``
(training-free) → evaluate each → save the most
compressed rootcov model and reload it → bench the original against it → write ``OUT/report.md``
with plots, and print the result table.

Budget: 12 min 7 s measured on 2 AMD EPYC cores with the defaults (the MLA row included) and a filled cache
(docs/results.md §3; evaluation capped at ``max_eval_tokens`` per corpus; the cap is recorded in every JSON).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

from .api import (compress, compress_from_statistics, convert_to_mla, evaluate_record, evaluation_blocks,
                  global_plan_from_statistics, load_model, save, teacher_statistics, write_json)
from .config import DEMO_CALIB_SAMPLES, DEMO_MAX_EVAL_TOKENS, CompressConfig, EvalConfig
from .eval.accounting import account
from .eval.table import format_results_table

__all__ = ["run_demo"]


def run_demo(out="runs/demo", model_name: str = "smollm2-135m", ratios=(0.1, 0.2, 0.3), latentllm_ratios=(),
             corpora=("wiki-eval", "austen"), calib_samples: int = DEMO_CALIB_SAMPLES, seq_len: int = 512,
             max_eval_tokens: int = DEMO_MAX_EVAL_TOKENS, bench: bool = True, progress: bool = True,
             global_allocation: bool = True, mla_kv_ratios=(0.25,)) -> Path:
    """Run the demo; returns the path of the written report.

    ``global_allocation``: also compress at every ratio with the same statistics and SVDs but ranks
    from one global budget priced by loss gradients (``allocation_weighting="fisher"``).
    ``mla_kv_ratios``: also convert the attention to MLA (training-free) at these KV budgets; the first
    one joins the benchmark (its cache bytes and decode speed beside the original's).
    """
    from .pipelines.mla import MLAConfig
    from .data.blocks import calibration_blocks
    from .data.corpora import load_text
    from .data.fetch import fetch
    from .eval.bench import bench_models
    from .eval.bench_table import format_bench_table
    from .eval.report import write_report

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    fetch(["all"], progress=progress)
    original, tokenizer = load_model(model_name)
    eval_config = EvalConfig(corpora=tuple(corpora), seq_len=seq_len, max_eval_tokens=max_eval_tokens)
    _say(f"evaluating the original {model_name} on {', '.join(corpora)} ({max_eval_tokens} tokens each)")
    blocks = {c: evaluation_blocks(tokenizer, c, seq_len, max_eval_tokens) for c in corpora}
    results = [evaluate_record(original, tokenizer, eval_config, progress=progress, blocks=blocks,
                               name=model_name).to_dict()]
    write_json(results[0], out / "original.json")
    before = account(original)
    calibration = calibration_blocks(tokenizer, load_text("wiki-calib"), seq_len, calib_samples)

    def keep(record, file_name):  # write the row's JSON, add it to the table, print it
        result = record.to_dict()
        write_json(result, out / file_name)
        results.append(result)
        print(format_results_table([result]).splitlines()[-1], flush=True)

    def finish(model, method, ratio, seconds, statistics):
        record = evaluate_record(model, tokenizer, eval_config, progress=progress, blocks=blocks, name=model_name,
                                 method=method, ratio=ratio, baseline=before)
        record.add_timings(compress=seconds)
        record.add_settings(calib="wiki-calib", calib_samples=calib_samples, calib_seq_len=seq_len,
                            statistics=statistics)
        keep(record, f"{method}-{ratio:g}.json")

    most_compressed = None
    if ratios:
        _say(f"calibration statistics of the original model ({calib_samples}×{seq_len} tokens of wiki-calib)")
        t0 = time.perf_counter()
        moments = teacher_statistics(original, calibration, progress=progress)
        statistics_seconds = time.perf_counter() - t0
        svd_cache: dict = {}  # each matrix's weighted SVD, truncated at every ratio
        for ratio in ratios:
            _say(f"asvd-rootcov at ratio {ratio}")
            model = copy.deepcopy(original)
            t0 = time.perf_counter()
            compress_from_statistics(model, CompressConfig(ratio=ratio, statistics="teacher", allocation="uniform"), moments, svd_cache)
            finish(model, "asvd-rootcov", ratio, statistics_seconds + time.perf_counter() - t0, "teacher")
            if ratio == max(ratios):
                most_compressed = (f"asvd-rootcov-{ratio:g}", model)
            else:
                del model
        importance = None
        for ratio in ratios if global_allocation else ():
            # Same statistics and SVDs, ranks from one global budget priced by loss gradients (allocation.py).
            _say(f"asvd-rootcov with global fisher allocation at ratio {ratio} (the default of `retrofitter compress`)")
            config = CompressConfig(ratio=ratio, statistics="teacher", allocation="global", allocation_weighting="fisher")
            t0 = time.perf_counter()
            plan, plan_report = global_plan_from_statistics(original, config, moments, svd_cache, calibration, importance)
            importance = plan_report["importance"]
            model = copy.deepcopy(original)
            compress_from_statistics(model, config, moments, svd_cache, plan=plan)
            finish(model, "rootcov-global-fisher", ratio, statistics_seconds + time.perf_counter() - t0, "teacher")
            del model
        del moments, svd_cache
    for ratio in latentllm_ratios:
        _say(f"latentllm at ratio {ratio} (sequential pipeline)")
        model = copy.deepcopy(original)
        t0 = time.perf_counter()
        compress(model, CompressConfig(ratio=ratio, method="latentllm"), calibration, progress=progress)
        finish(model, "latentllm", ratio, time.perf_counter() - t0, "compressed")
        del model

    mla_models = []
    for kv_ratio in mla_kv_ratios:
        _say(f"MLA attention at KV {kv_ratio} of the original's cache (training-free)")
        model = copy.deepcopy(original)
        t0 = time.perf_counter()
        # served without heal: fold the square up-projections now (exact; fewer multiply-adds per token)
        mla_config = MLAConfig(kv_ratio=kv_ratio, fold_up_projections=True)
        convert_to_mla(model, mla_config, calibration, progress=progress)
        record = evaluate_record(model, tokenizer, eval_config, progress=progress, blocks=blocks, name=model_name,
                                 method=f"mla-kv{kv_ratio:g}", ratio=None, baseline=before)
        record.add_timings(convert=time.perf_counter() - t0)
        record.add_settings(calib="wiki-calib", calib_samples=calib_samples, calib_seq_len=seq_len,
                            mla_config=mla_config.to_dict())
        keep(record, f"mla-kv{kv_ratio:g}.json")
        mla_models.append((f"mla-kv{kv_ratio:g}", model))
    if most_compressed is not None:
        label, model = most_compressed
        saved = save(model, out / "models" / label, tokenizer=tokenizer,
                     metadata={"method": "asvd-rootcov", "ratio": max(ratios), "source_model": model_name},
                     overwrite=True)
        reloaded, _ = load_model(str(saved))
        ids = calibration[:1, :64]
        with torch.no_grad():
            same = torch.allclose(reloaded(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
        _say(f"saved {saved} and reloaded it: logits {'identical' if same else 'DIFFER'}")
        if bench:
            _say(f"benchmarking {model_name} against {label} (interleaved repetitions)")
            measured = bench_models([(model_name, original, tokenizer), (label, reloaded, tokenizer),
                                     *[(name, m, tokenizer) for name, m in mla_models[:1]]],
                                    prefill_len=512, contexts=(256, 1024, 2048) if mla_models else (256, 1024),
                                    decode_tokens=16, repeats=2, warmup=1)
            write_json(measured, out / "bench.json")
            print(format_bench_table(measured))
    report = write_report([out], out=out, title=f"retrofitter demo: {model_name}")
    print()
    print(format_results_table(results))
    print(f"\nreport: {report}  (total {time.perf_counter() - started:.0f}s)")
    return report


def _say(message: str) -> None:
    print(f"[demo] {message}", flush=True)
