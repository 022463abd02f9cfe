"""Issue 3 benchmark: local activation-aware SVD variants on the default model, side by side, one run.

Measures, on SmolLM2-135M (wiki-calib calibration, perplexity on wiki-eval and austen):
the original, then every local method at each ratio — plain SVD, ASVD with hessian / l2 / cov /
rootcov preconditioners, SVD-LLM (Cholesky whitening) — all fitted on the *teacher* statistics of
one shared calibration pass (so the methods differ only in the factorization), plus asvd-rootcov
with sequential ("compressed") statistics, the pipeline's default, timed end to end.

    python benchmarks/compress_methods.py [--ratios 0.1,0.2,0.3] [--max-eval-tokens 16384]
    python benchmarks/compress_methods.py --max-eval-tokens 4096      # the README table (CPU budget)

"compress s" is the statistics pass plus the method's SVD-computing call (what one standalone
compress run costs); "peak RSS MiB" is the process RSS sampled while the method ran (the process
also holds the original model, the shared teacher statistics and the evaluation data).

Writes benchmarks/results/compress_methods.json and .md and prints the table.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import time
from pathlib import Path

import torch

from common import machine_info, perplexities
from retrofitter.api import (compress, compress_from_statistics, global_plan_from_statistics, load_model,
                             teacher_statistics, write_json)
from retrofitter.config import CompressConfig
from retrofitter.data.blocks import token_blocks
from retrofitter.data.corpora import load_text
from retrofitter.eval.accounting import account
from retrofitter.eval.resources import peak_rss_mb, sampled_rss

METHODS = ["svd", "asvd-hessian", "asvd-l2", "asvd-cov", "asvd-rootcov", "svd-llm"]


def row(label, method, ratio, model, before, ppl, seconds, note="", fit_seconds=None) -> dict:
    acc = account(model)
    return {"label": label, "method": method, "ratio": ratio, "ppl": ppl,
            "params": acc.params_dict(),
            "reduction": {"linear": 1 - acc.params_linear / before.params_linear,
                          "total": 1 - acc.params_total / before.params_total},
            "compress_seconds": seconds, "fit_seconds": fit_seconds, "process_peak_rss_mb": peak_rss_mb(),
            "note": note}


def markdown(rows, corpora) -> str:
    head = ["method", "ratio", "statistics", *[f"ppl {c}" for c in corpora], "linear red.", "total red.", "compress s",
            "peak RSS MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ppl = [f"{r['ppl'][c]:.2f}" if r["ppl"][c] < 1e4 else f"{r['ppl'][c]:.3g}" for c in corpora]
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:g}"
        lines.append("| " + " | ".join([r["method"], ratio, r["note"], *ppl, f"{r['reduction']['linear']:.1%}",
                                        f"{r['reduction']['total']:.1%}", f"{r['compress_seconds']:.0f}",
                                        f"{r['method_peak_rss_mb']:.0f}" if r.get("method_peak_rss_mb") else "-"]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--ratios", default="0.1,0.2,0.3")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--extra-ratios", default="", help="further ratios, run only for --extra-methods")
    parser.add_argument("--extra-methods", default="svd,asvd-rootcov")
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--eval", default="wiki-eval,austen")
    parser.add_argument("--max-eval-tokens", type=int, default=16384)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--no-sequential", action="store_true", help="skip the sequential-statistics rootcov rows")
    parser.add_argument("--global-weightings", default="relative,fisher",
                        help="asvd-rootcov with global allocation under these weightings ('' to skip)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/compress_methods"))
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ratios = [float(r) for r in args.ratios.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    corpora = [c for c in args.eval.split(",") if c]
    global_weightings = [w for w in args.global_weightings.split(",") if w]

    started = time.perf_counter()
    original, tokenizer = load_model(args.model)
    calibration = token_blocks(tokenizer, load_text("wiki-calib"), seq_len=args.seq_len, max_blocks=args.calib_samples)
    eval_blocks = {c: token_blocks(tokenizer, load_text(c), seq_len=args.seq_len, max_tokens=args.max_eval_tokens)
                   for c in corpora}
    before = account(original)
    rows = []
    t0 = time.perf_counter()
    rows.append(row("original", "original", None, original, before, perplexities(original, eval_blocks, 4), 0.0))
    print(markdown(rows[-1:], corpora), flush=True)
    t0 = time.perf_counter()
    moments = teacher_statistics(original, calibration, batch_size=args.batch_size)
    statistics_seconds = time.perf_counter() - t0
    print(f"teacher statistics pass: {statistics_seconds:.0f}s", flush=True)
    extra_ratios = [float(r) for r in args.extra_ratios.split(",") if r]
    extra_methods = [m for m in args.extra_methods.split(",") if m]
    schedule = {method: list(ratios) for method in methods}
    for method in extra_methods:
        schedule.setdefault(method, [])
        schedule[method] += [r for r in extra_ratios if r not in schedule[method]]
    for method, method_ratios in schedule.items():
        # One weighted SVD per matrix for all ratios of this method (truncation is all that differs).
        # A standalone `retrofitter compress` run would do statistics + SVDs + one truncation, which is
        # what "compress s" reports: statistics pass + this method's first (SVD-computing) call.
        svd_cache: dict = {}
        first_call_seconds = None
        memory: dict = {}
        with sampled_rss(memory):
            for ratio in method_ratios:
                model = copy.deepcopy(original)
                t0 = time.perf_counter()
                try:
                    compress_from_statistics(model, CompressConfig(ratio=ratio, method=method, statistics="teacher",
                                                                    allocation="uniform"),
                                          moments, svd_cache=svd_cache)
                    fit_seconds = time.perf_counter() - t0
                    ppl = perplexities(model, eval_blocks, 4)
                    note = "teacher"
                except (ValueError, FloatingPointError) as error:  # e.g. an ill-conditioned junction: report it
                    fit_seconds = time.perf_counter() - t0
                    ppl, note = {c: float("nan") for c in corpora}, f"failed: {error}"[:200]
                first_call_seconds = fit_seconds if first_call_seconds is None else first_call_seconds
                rows.append(row(f"{method}@{ratio}", method, ratio, model, before, ppl,
                                statistics_seconds + first_call_seconds, note, fit_seconds=fit_seconds))
                print(markdown(rows[-1:], corpora).splitlines()[-1], flush=True)
                write_results(args, rows, corpora, calibration, eval_blocks, started, statistics_seconds)
                del model
            if method == "asvd-rootcov" and global_weightings:
                # Global allocation on the same teacher statistics: the cached SVDs' singular values are the
                # exact rootcov error spectra, so every global plan costs only a truncation + evaluation.
                importance, gradient_seconds = None, 0.0
                for weighting in global_weightings:
                    for ratio in method_ratios:
                        config = CompressConfig(ratio=ratio, method=method, statistics="teacher", allocation="global",
                                                allocation_weighting=weighting)
                        t0 = time.perf_counter()
                        plan, plan_report = global_plan_from_statistics(original, config, moments, svd_cache, calibration,
                                                                importance if weighting == "fisher" else None)
                        if weighting == "fisher" and importance is None:
                            importance, gradient_seconds = plan_report["importance"], time.perf_counter() - t0
                        model = copy.deepcopy(original)
                        compress_from_statistics(model, config, moments, svd_cache=svd_cache, plan=plan)
                        fit_seconds = time.perf_counter() - t0
                        if weighting == "fisher" and ratio != method_ratios[0]:
                            fit_seconds += gradient_seconds  # the first fisher call already includes it
                        ppl = perplexities(model, eval_blocks, 4)
                        rows.append(row(f"{method}-global-{weighting}@{ratio}", method, ratio, model, before, ppl,
                                        statistics_seconds + first_call_seconds + fit_seconds,
                                        f"teacher, global {weighting}", fit_seconds=fit_seconds))
                        rows[-1]["keep_fraction_by_projection"] = plan_report["keep_fraction_by_projection"]
                        rows[-1]["keep_fraction_by_layer"] = plan_report["keep_fraction_by_layer"]
                        print(markdown(rows[-1:], corpora).splitlines()[-1], flush=True)
                        write_results(args, rows, corpora, calibration, eval_blocks, started, statistics_seconds)
                        del model
        for r in rows:
            if r["method"] == method and r["note"] != "sequential" and "method_peak_rss_mb" not in r:
                r["method_peak_rss_mb"] = memory["peak_mb"]
        del svd_cache
    if not args.no_sequential:
        for ratio in ratios:
            model = copy.deepcopy(original)
            memory = {}
            t0 = time.perf_counter()
            with sampled_rss(memory):
                _, report = compress(model, CompressConfig(ratio=ratio, method="asvd-rootcov",
                                                                 statistics="compressed", allocation="uniform",
                                                                 batch_size=args.batch_size),
                                           calibration, progress=False)
            seconds = time.perf_counter() - t0
            rows.append(row(f"asvd-rootcov-seq@{ratio}", "asvd-rootcov", ratio, model, before,
                            perplexities(model, eval_blocks, 4), seconds, "sequential", fit_seconds=seconds))
            rows[-1]["method_peak_rss_mb"] = memory["peak_mb"]
            rows[-1]["timings_s"] = report["timings_s"]  # capture / statistics / factorization / propagation
            print(markdown(rows[-1:], corpora).splitlines()[-1], report["timings_s"], flush=True)
            write_results(args, rows, corpora, calibration, eval_blocks, started, statistics_seconds)
            del model
    write_results(args, rows, corpora, calibration, eval_blocks, started, statistics_seconds, final=True)


def write_results(args, rows, corpora, calibration, eval_blocks, started, statistics_seconds, final=False) -> None:
    """(Re)write the JSON and markdown table; called after every row so an interrupted run keeps its rows."""
    order = {m: i for i, m in enumerate(["original", *METHODS])}
    rows = sorted(rows, key=lambda r: (r["ratio"] or 0.0, r["note"] == "sequential", "global" in r["note"],
                                       order.get(r["method"], 99), r["note"]))
    settings = {"model": args.model, "calib": "wiki-calib", "calib_samples": int(calibration.shape[0]),
                "seq_len": args.seq_len, "eval": corpora, "max_eval_tokens": args.max_eval_tokens,
                "eval_tokens": {c: int(b.numel()) for c, b in eval_blocks.items()},
                "damping": CompressConfig().damping, "junction": True, "threads": torch.get_num_threads(),
                "cpu": machine_info()["cpu"], "torch": torch.__version__,
                "date": datetime.date.today().isoformat(), "wall_seconds": time.perf_counter() - started,
                "statistics_pass_seconds": statistics_seconds}
    table = markdown(rows, corpora)
    write_json({"kind": "compress_methods", "settings": settings, "rows": rows}, args.out.with_suffix(".json"))
    args.out.with_suffix(".md").write_text(
        f"Measured {settings['date']} on {settings['cpu']} ({settings['threads']} threads); "
        f"calibration wiki-calib {settings['calib_samples']}×{args.seq_len}; eval seq {args.seq_len}, "
        f"{args.max_eval_tokens} tokens per corpus. \"compress s\" = teacher statistics pass + the method's "
        f"SVD-computing call; \"peak RSS\" = process RSS sampled while the method ran (the process also holds "
        f"the original model and the shared statistics).\n\n{table}\n")
    if final:
        print(table)
        print(json.dumps(settings, indent=1))


if __name__ == "__main__":
    main()
