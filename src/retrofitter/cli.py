"""Command line: ``retrofitter {fetch,compress,eval,...}``; each command mirrors an API function."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

__all__ = ["main", "build_parser"]


def _corpus_list(text: str) -> tuple[str, ...]:
    items = tuple(part.strip() for part in text.split(",") if part.strip())
    if not items:
        raise argparse.ArgumentTypeError("give at least one corpus name")
    return items


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, help="write the results JSON here")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_eval_options(parser: argparse.ArgumentParser, flag: str, default: str) -> None:
    parser.add_argument(flag, type=_corpus_list, default=_corpus_list(default),
                        help=f"comma-separated evaluation corpora (default {default}): built-in names, "
                             "a .txt file or directory, or hf:DATASET[:CONFIG][:SPLIT]")
    parser.add_argument("--eval-seq-len", type=int, default=None,
                        help="perplexity window length (default: --seq-len)")
    parser.add_argument("--max-eval-tokens", type=int, default=None, help="cap on evaluation tokens per corpus")
    parser.add_argument("--eval-batch-size", type=int, default=4)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        items = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not items or min(items) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return items


def _add_bench_and_report(commands) -> None:
    bench = commands.add_parser("bench", help="measured prefill latency, decode speed, cache bytes and memory")
    bench.add_argument("models", nargs="+", help="models to compare (first is the reference for ratios)")
    bench.add_argument("--prefill-len", type=int, default=512, help="prefill length in tokens (default 512)")
    bench.add_argument("--contexts", type=_int_list, default=(256, 1024, 4096),
                       help="comma-separated decode contexts (default 256,1024,4096)")
    bench.add_argument("--decode-tokens", type=int, default=32, help="timed greedy decode steps (default 32)")
    bench.add_argument("--repeats", type=int, default=3, help="timed repetitions per model (default 3)")
    bench.add_argument("--warmup", type=int, default=1, help="untimed warm-up repetitions (default 1)")
    bench.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    _add_common(bench)

    report = commands.add_parser("report", help="report.md + plots from results and bench JSONs in run dirs")
    report.add_argument("run_dirs", nargs="+", type=Path, help="directories holding *.json results (or JSON files)")
    report.add_argument("--out", type=Path, default=None, help="output directory (default: the first run dir)")


def build_parser() -> argparse.ArgumentParser:
    from .config import ALLOCATION_WEIGHTINGS, COMPRESS_METHODS

    parser = argparse.ArgumentParser(prog="retrofitter", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", help="logging level (INFO shows per-layer progress)")
    commands = parser.add_subparsers(dest="command", required=True)

    fetch = commands.add_parser("fetch", help="download the default model and corpora into the cache")
    fetch.add_argument("names", nargs="*", default=["all"], help="smollm2-135m, wiki, austen or all (default)")
    fetch.add_argument("--quiet", action="store_true")

    evaluate = commands.add_parser("eval", help="perplexity and accounting of a model")
    evaluate.add_argument("model", help="alias (smollm2-135m), local HF dir, saved retrofitter dir or hub id")
    _add_eval_options(evaluate, "--ppl", "wiki-eval")
    evaluate.add_argument("--seq-len", type=int, default=512)
    evaluate.add_argument("--tasks", type=_corpus_list, default=None,
                          help="comma-separated lm-eval tasks or task YAML paths (needs the lm-eval extra)")
    evaluate.add_argument("--tasks-limit", type=float, default=None, help="lm-eval examples per task (or a fraction)")
    _add_common(evaluate)
    _add_bench_and_report(commands)

    compress = commands.add_parser("compress", help="LatentLLM-style training-free low-rank compression")
    compress.add_argument("model")
    compress.add_argument("--method", default="asvd-rootcov", choices=list(COMPRESS_METHODS))
    compress.add_argument("--ratio", type=float, required=True, help="fraction of linear-layer parameters removed, in (0,1)")
    compress.add_argument("--calib", default="wiki-calib", help="calibration corpus (default wiki-calib)")
    compress.add_argument("--calib-samples", type=int, default=64, help="calibration blocks (default 64)")
    compress.add_argument("--seq-len", type=int, default=512, help="calibration block length (default 512)")
    compress.add_argument("--out", type=Path, required=True, help="output directory (safetensors)")
    compress.add_argument("--overwrite", action="store_true", help="replace an existing --out once the new one is complete")
    compress.add_argument("--statistics", choices=["compressed", "teacher"], default="compressed",
                          help="calibrate layer l on the compressed (default) or the original model's activations")
    compress.add_argument("--damping", type=float, default=1e-2)
    compress.add_argument("--no-junction", action="store_true", help="store plain B, A factors (r(d+d') parameters)")
    compress.add_argument("--targets", default="", help="comma-separated projections to compress (default all)")
    compress.add_argument("--batch-size", type=int, default=8, help="calibration batch size")
    compress.add_argument("--allocation", choices=["uniform", "global"], default=None,
                          help="uniform: every matrix keeps 1-ratio of its parameters; global: ranks by water-filling "
                               "on the weighted spectra of all matrices under one budget (default: global for "
                               "latentllm, uniform for the other methods)")
    compress.add_argument("--allocation-weighting", choices=list(ALLOCATION_WEIGHTINGS), default="fisher",
                          help="global allocation: how errors of different matrices compare (default fisher: "
                               "priced by the loss gradient at each matrix's output; relative: relative error)")
    compress.add_argument("--allocation-min-keep", type=float, default=0.0,
                          help="global allocation: each matrix keeps at least this fraction of its parameters")
    compress.add_argument("--allocation-gradient-blocks", type=int, default=8,
                          help="fisher weighting: calibration blocks for the backward passes (default 8)")
    latentllm = compress.add_argument_group("latentllm parts (ablations)")
    latentllm.add_argument("--no-joint-qk", action="store_true", help="local factors for q and k")
    latentllm.add_argument("--joint-vo", action="store_true", help="joint VO decomposition (default local v, o)")
    latentllm.add_argument("--no-joint-mlp", action="store_true", help="local factors for the MLP")
    latentllm.add_argument("--qk-iterations", type=int, default=8, help="joint QK alternating iterations")
    latentllm.add_argument("--mlp-algorithm", choices=["streaming", "auxiliary"], default="streaming")
    latentllm.add_argument("--no-latent-attention", action="store_true",
                           help="keep HF attention with factored projections (no latent KV cache)")
    compress.add_argument("--measure-cost", action="store_true",
                          help="also time one plain forward over the calibration tokens (compression cost ratio)")
    _add_eval_options(compress, "--eval", "wiki-eval")
    compress.add_argument("--no-eval", action="store_true", help="skip evaluation of the result")
    _add_common(compress)
    _add_linearize_parser(commands)
    demo = commands.add_parser("demo", help="the main job on the default model: fetch, compress, eval, bench, report")
    demo.add_argument("--out", type=Path, default=Path("runs/demo"))
    demo.add_argument("--model", default="smollm2-135m")
    demo.add_argument("--ratios", default="0.1,0.2,0.3", help="asvd-rootcov ratios (one shared statistics pass)")
    demo.add_argument("--latentllm-ratios", default="",
                      help="also run latentllm at these ratios, e.g. 0.3 (default: none; not yet measured on the real model)")
    demo.add_argument("--max-eval-tokens", type=int, default=4096, help="evaluation tokens per corpus")
    demo.add_argument("--calib-samples", type=int, default=32, help="calibration blocks of 512 tokens (default 32)")
    demo.add_argument("--no-bench", action="store_true")
    demo.add_argument("--no-global", action="store_true",
                      help="skip the asvd-rootcov rows with global (fisher) rank allocation")
    demo.add_argument("--quiet", action="store_true")
    return parser


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.WARNING),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def cmd_fetch(args) -> int:
    from .data.fetch import fetch

    paths = fetch(args.names, progress=not args.quiet)
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def _eval_config(args, seq_len: int, corpora):
    from .config import EvalConfig

    return EvalConfig(corpora=tuple(corpora), seq_len=args.eval_seq_len or seq_len,
                      max_eval_tokens=args.max_eval_tokens, batch_size=args.eval_batch_size)


def cmd_eval(args) -> int:
    from .api import evaluate, load_model, write_json
    from .checkpoint import is_retrofitted_dir
    from .eval.table import format_results_table

    if args.tasks:
        from .eval.lm_eval_harness import lm_eval_available

        if not lm_eval_available():  # fail before the (slow) perplexity evaluation
            raise ValueError("--tasks needs lm-eval: pip install 'retrofitter[lm-eval]'")
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    results = evaluate(model, tokenizer, _eval_config(args, args.seq_len, args.ppl), progress=not args.quiet)
    results["model"] = args.model
    if is_retrofitted_dir(args.model):
        import json

        info = json.loads((Path(args.model) / "retrofitter.json").read_text())
        results["method"], results["ratio"] = info.get("method", "retrofitted"), info.get("ratio")
    if args.tasks:
        from .eval.lm_eval_harness import run_lm_eval

        limit = args.tasks_limit if args.tasks_limit is None or args.tasks_limit < 1 else int(args.tasks_limit)
        results["lm_eval"] = run_lm_eval(model, tokenizer, list(args.tasks), limit=limit)
        for task, metrics in results["lm_eval"]["tasks"].items():
            print(f"lm-eval {task}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if v is not None))
    print(format_results_table([results]))
    if args.json:
        write_json(results, args.json)
    return 0


def cmd_compress(args) -> int:
    import torch

    from .api import compress, evaluate, load_model, save, write_json
    from .checkpoint import prepare_output_dir
    from .config import CompressConfig
    from .data.blocks import token_blocks
    from .data.corpora import load_text
    from .eval.accounting import account
    from .eval.resources import current_rss_mb, peak_rss_mb, sampled_rss
    from .eval.table import format_results_table
    from .pipelines.compress import CalibrationError

    prepare_output_dir(args.out, args.overwrite)  # fail before any work
    config = CompressConfig(ratio=args.ratio, method=args.method, junction=not args.no_junction,
                            statistics=args.statistics, damping=args.damping,
                            targets=tuple(t for t in args.targets.split(",") if t), batch_size=args.batch_size,
                            allocation=args.allocation, allocation_weighting=args.allocation_weighting,
                            allocation_min_keep=args.allocation_min_keep,
                            allocation_gradient_blocks=args.allocation_gradient_blocks,
                            joint_qk=not args.no_joint_qk, joint_vo=args.joint_vo, joint_mlp=not args.no_joint_mlp,
                            qk_iterations=args.qk_iterations, mlp_algorithm=args.mlp_algorithm,
                            latent_attention=not args.no_latent_attention)
    timings = {}
    start = time.perf_counter()
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    timings["load"] = time.perf_counter() - start
    calibration = token_blocks(tokenizer, load_text(args.calib), seq_len=args.seq_len, max_blocks=args.calib_samples)
    if calibration.shape[0] < args.calib_samples:
        raise CalibrationError(f"calibration corpus {args.calib!r} gives only {calibration.shape[0]} blocks of "
                               f"{args.seq_len} tokens; --calib-samples asks for {args.calib_samples}")
    before = account(model)
    memory = {"after_load": current_rss_mb()}
    if args.measure_cost:
        from .eval.perplexity import perplexity

        t0 = time.perf_counter()
        perplexity(model, calibration, batch_size=args.batch_size, progress=False)
        timings["calibration_forward"] = time.perf_counter() - t0
        memory["after_calibration_forward"] = current_rss_mb()
    checkpoint_dir = args.out.parent / f".{args.out.name}.partial"
    compress_memory: dict = {}
    with sampled_rss(compress_memory, interval_s=0.05):  # the compression alone (not the --measure-cost forward)
        model, report = compress(model, config, calibration, progress=not args.quiet, checkpoint_dir=checkpoint_dir)
    timings["compress"] = report["timings_s"]["total"]
    compress_peak = compress_memory["peak_mb"]
    metadata = {"method": args.method, "ratio": args.ratio, "source_model": args.model,
                "config": config.to_dict(), "calibration": {"corpus": args.calib, "blocks": calibration.shape[0],
                                                            "seq_len": args.seq_len},
                "ranks": {f"{r['layer']}.{name}": e["rank"] for r in report["layers"] for name, e in r["matrices"].items()}}
    t0 = time.perf_counter()
    save(model, args.out, tokenizer=tokenizer, metadata=metadata, overwrite=args.overwrite)
    timings["save"] = time.perf_counter() - t0
    if args.no_eval:
        after = account(model)
        results = {"model": args.model, "ppl": {}, "params": after.params_dict(),
                   "kv_bytes_per_token": after.kv_bytes_per_token, "macs_per_token": after.macs_per_token,
                   "settings": {}, "timings_s": {}}
    else:
        results = evaluate(model, tokenizer, _eval_config(args, args.seq_len, args.eval), progress=not args.quiet)
    results.update({"model": args.model, "method": args.method, "ratio": args.ratio, "out": str(args.out)})
    results["settings"].update({"calib": args.calib, "calib_samples": calibration.shape[0], "calib_seq_len": args.seq_len,
                                "compress_config": config.to_dict(), "threads": torch.get_num_threads()})
    results["timings_s"].update(timings)
    results["timings_s"]["compress_breakdown"] = report["timings_s"]
    results["params_before"] = before.params_dict()
    results["reduction"] = {
        "linear": 1 - results["params"]["linear"] / before.params_linear,
        "total": 1 - results["params"]["total"] / before.params_total,
    }
    results["peak_rss_mb"] = peak_rss_mb()
    results["compress_peak_rss_mb"] = compress_peak
    fp32_mb = before.params_total * 4 / 2**20
    results["cost"] = {"peak_rss_over_fp32_model": compress_peak / fp32_mb, "fp32_model_mb": fp32_mb,
                       "rss_mb": {**memory, "after_capture": report.get("rss_after_capture_mb"),
                                  "after_each_layer": [r.get("rss_mb") for r in report["layers"]]}}
    if "calibration_forward" in timings:
        results["cost"]["compress_over_calibration_forward"] = timings["compress"] / timings["calibration_forward"]
    results["layers"] = report["layers"]
    print(format_results_table([results]))
    if args.json:
        write_json(results, args.json)
    return 0


def cmd_bench(args) -> int:
    import torch

    from .api import load_model, write_json
    from .eval.bench import bench_models, format_bench_table, unique_labels

    if args.threads:
        torch.set_num_threads(args.threads)
    models = [(label, *load_model(name, dtype=args.dtype, device=args.device))
              for label, name in zip(unique_labels(args.models), args.models)]
    bench = bench_models(models, prefill_len=args.prefill_len, contexts=args.contexts, decode_tokens=args.decode_tokens,
                         repeats=args.repeats, warmup=args.warmup, progress=not args.quiet)
    print(format_bench_table(bench))
    if args.json:
        write_json(bench, args.json)
    return 0


def cmd_report(args) -> int:
    from .eval.report import write_report

    print(f"wrote {write_report(args.run_dirs, args.out)}")
    return 0



def _layer_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got {text!r}") from None


def _add_linearize_parser(commands) -> None:
    from .config import LINEARIZE_PRESETS

    linearize = commands.add_parser("linearize", help="LoLCATs: hybrid window-softmax + linear attention, "
                                    "attention transfer then LoRA")
    linearize.add_argument("model")
    linearize.add_argument("--preset", choices=sorted(LINEARIZE_PRESETS),
                           help="named budget; explicit flags override it. " + "; ".join(
                               f"{name}: {p['description']}" for name, p in LINEARIZE_PRESETS.items()))
    # None = take the preset's (or LinearizeConfig's) value.
    for flag, kind in (("--feature-map", str), ("--feature-dim", int), ("--window", int), ("--window-kind", str),
                       ("--linear-weight", str), ("--transfer-tokens", int), ("--lora-tokens", int),
                       ("--seq-len", int), ("--batch-size", int), ("--transfer-lr", float), ("--transfer-epochs", int),
                       ("--transfer-mode", str), ("--lora-lr", float), ("--lora-rank", int), ("--lora-alpha", int),
                       ("--seed", int)):
        linearize.add_argument(flag, type=kind, default=None)
    linearize.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_const",
                           const=False, default=None,
                           help="keep every layer's activations in the LoRA stage (faster, memory grows ~10x)")
    linearize.add_argument("--keep-softmax-layers", type=_layer_list, default=None,
                           help="comma-separated layer indices that keep softmax attention, e.g. 0,1")
    linearize.add_argument("--train-corpus", default="wiki-calib", help="training text (default wiki-calib)")
    linearize.add_argument("--work-dir", type=Path, default=None,
                           help="block-wise transfer cache (default: next to --out; reused to resume)")
    linearize.add_argument("--out", type=Path, required=True, help="output directory (safetensors)")
    linearize.add_argument("--overwrite", action="store_true", help="replace an existing --out once the new one is complete")
    _add_eval_options(linearize, "--eval", "wiki-eval")
    linearize.add_argument("--no-eval", action="store_true", help="skip evaluation of the result")
    linearize.add_argument("--eval-original", action="store_true", help="also evaluate the model before linearizing")
    _add_common(linearize)


def cmd_linearize(args) -> int:
    import dataclasses

    from .api import evaluate, linearize, load_model, save, write_json
    from .checkpoint import prepare_output_dir
    from .config import LINEARIZE_PRESETS, LinearizeConfig
    from .data.blocks import token_blocks
    from .data.corpora import load_text
    from .eval.accounting import account
    from .eval.resources import current_rss_mb, peak_rss_mb
    from .eval.table import format_results_table

    prepare_output_dir(args.out, args.overwrite)  # fail before any work
    names = {f.name for f in dataclasses.fields(LinearizeConfig)}
    overrides = {name: value for name, value in vars(args).items() if name in names and value is not None}
    config = LinearizeConfig.preset(args.preset, **overrides) if args.preset else LinearizeConfig(**overrides)
    if args.preset and args.max_eval_tokens is None:
        args.max_eval_tokens = LINEARIZE_PRESETS[args.preset]["eval_max_tokens"]
    eval_config = _eval_config(args, config.seq_len, args.eval)
    timings, start = {}, time.perf_counter()
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    timings["load"] = time.perf_counter() - start
    original = evaluate(model, tokenizer, eval_config, progress=not args.quiet) if args.eval_original else None
    # Transfer and LoRA read consecutive, disjoint blocks of the training text while it lasts.
    wanted = config.transfer_tokens + config.lora_tokens
    blocks = token_blocks(tokenizer, load_text(args.train_corpus), config.seq_len, max_tokens=max(wanted, config.seq_len))
    n_transfer = max(1, config.transfer_tokens // config.seq_len)
    n_lora = max(1, config.lora_tokens // config.seq_len)
    transfer_blocks = blocks[:n_transfer]
    lora_blocks = blocks[n_transfer:n_transfer + n_lora] if blocks.shape[0] >= n_transfer + n_lora else blocks[:n_lora]
    work_dir = args.work_dir or args.out.parent / f".{args.out.name}.transfer"
    model, report = linearize(model, config, transfer_blocks, lora_blocks, progress=not args.quiet, work_dir=work_dir)
    timings.update(report["timings_s"])
    linearize_peak = peak_rss_mb()
    metadata = {"method": "lolcats", "ratio": None, "source_model": args.model, "config": config.to_dict(),
                "preset": args.preset, "replaced_layers": report["replaced_layers"]}
    t0 = time.perf_counter()
    save(model, args.out, tokenizer=tokenizer, metadata=metadata, overwrite=args.overwrite)
    timings["save"] = time.perf_counter() - t0
    if args.no_eval:
        after = account(model)
        results = {"ppl": {}, "params": after.params_dict(), "kv_bytes_per_token": after.kv_bytes_per_token,
                   "settings": {}, "timings_s": {}}
    else:
        results = evaluate(model, tokenizer, eval_config, progress=not args.quiet)
    hybrid = [m for m in model.modules() if hasattr(m, "state_numbers")]
    dtype_bytes = next(model.parameters()).element_size()
    results.update({"model": args.model, "method": "lolcats", "ratio": None, "out": str(args.out),
                    "state_bytes_per_sequence": sum(m.state_numbers() for m in hybrid) * dtype_bytes})
    results["settings"].update({"linearize_config": config.to_dict(), "preset": args.preset,
                                "train_corpus": args.train_corpus, "transfer_blocks": list(transfer_blocks.shape),
                                "lora_blocks": list(lora_blocks.shape), "work_dir": str(work_dir)})
    results["timings_s"].update(timings)
    results["peak_rss_mb"] = peak_rss_mb()
    results["linearize_peak_rss_mb"] = linearize_peak
    if original is not None:
        results["ppl_original"] = original["ppl"]
    transfer = report.get("transfer", {})
    results["transfer_mse"] = {str(k): v for k, v in transfer.get("layers", {}).items()}
    results["lora"] = {k: v for k, v in report.get("lora", {}).items() if k != "loss_history"}
    print(format_results_table([r for r in (original, results) if r is not None]))
    if args.json:
        write_json(results, args.json)
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    run_demo(out=args.out, model_name=args.model, ratios=tuple(float(r) for r in args.ratios.split(",") if r),
             latentllm_ratios=tuple(float(r) for r in args.latentllm_ratios.split(",") if r),
             max_eval_tokens=args.max_eval_tokens,
             calib_samples=args.calib_samples, bench=not args.no_bench, progress=not args.quiet,
             global_allocation=not args.no_global)
    return 0


COMMANDS = {"demo": cmd_demo, "linearize": cmd_linearize, "fetch": cmd_fetch, "eval": cmd_eval, "compress": cmd_compress, "bench": cmd_bench, "report": cmd_report}


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(args.log_level)
    try:
        return COMMANDS[args.command](args)
    except (ValueError, FileExistsError, FileNotFoundError, OSError) as error:
        # Known user-facing failures: one clear line, no traceback (use --log-level DEBUG for it).
        logging.getLogger("retrofitter").debug("traceback", exc_info=True)
        print(f"retrofitter {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
