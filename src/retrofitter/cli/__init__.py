"""Command line: ``retrofitter {fetch,compress,mla,linearize,recall,heal,sample,export,eval,bench,report,demo}``.

Each command maps its flags onto one function (``jobs``, ``demo``, ``eval.bench``, ``eval.report``)
and prints / writes what it returns. The flags of ``compress`` and ``linearize`` are generated from
the fields of ``CompressConfig`` / ``LinearizeConfig`` (help texts and defaults live there, once).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from pathlib import Path

from ..config import (COMPRESS_CALIB_SAMPLES, DEMO_CALIB_SAMPLES, DEMO_MAX_EVAL_TOKENS, LINEARIZE_PRESETS,
                      MLA_CALIB_SAMPLES, MLA_SEQ_LEN, CompressConfig, HealConfig, LinearizeConfig)
from ..pipelines.mla import MLA_PRESETS, MLAConfig
from ..pipelines.recall_layers import RANKINGS
from ..errors import RetrofitterError
from .flags import (add_config_flags, compress_config_from_args, config_from_args, fraction_list, method_options, name_list,
                    positive_int_list)
from .common import (OneLineParser, add_common, add_eval_flags, add_job_flags, add_quantize_flag, eval_config,
                     show_results)
from .guards import check_json_output, input_paths, quiet_libraries
from .sample import add_sample_command, cmd_sample

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from ..modules.feature_maps import FEATURE_MAPS
    from ..eval.decode_loop import MATVEC_CHOICES
    from ..modules.quantize import QUANTIZE_SCHEMES
    from ..ops.hybrid_common import LINEAR_WEIGHTS, WINDOW_KINDS

    parser = OneLineParser(prog="retrofitter", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", help="logging level (INFO shows per-layer progress)")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error (or RETROFITTER_DEBUG=1)")
    commands = parser.add_subparsers(dest="command", required=True)

    fetch = commands.add_parser("fetch", help="download the default model and corpora into the cache")
    fetch.add_argument("names", nargs="*", default=["all"], help="smollm2-135m, wiki, austen or all (default)")
    fetch.add_argument("--force", action="store_true", help="fetch again even if cached (repairs a damaged file)")
    fetch.add_argument("--quiet", action="store_true")

    evaluate = commands.add_parser("eval", help="perplexity and accounting of any causal LM")
    evaluate.add_argument("model", help="alias (smollm2-135m), local HF dir, saved retrofitter dir or hub id")
    add_eval_flags(evaluate, "--ppl", "wiki-eval")
    evaluate.add_argument("--seq-len", type=int, default=512)
    evaluate.add_argument("--tasks", type=name_list, default=(),
                          help="comma-separated lm-eval tasks or task YAML paths (needs the lm-eval extra)")
    evaluate.add_argument("--tasks-limit", type=float, default=None, help="lm-eval examples per task (or a fraction)")
    evaluate.add_argument("--passkey", type=positive_int_list, default=(), metavar="CONTEXTS",
                          help="passkey retrieval at these prompt lengths, e.g. 2048,4096 (3 depths x --passkey-trials)")
    evaluate.add_argument("--passkey-trials", type=int, default=2, help="random pass keys per context and depth")
    evaluate.add_argument("--passkey-depths", type=fraction_list, default=(0.1, 0.5, 0.9), metavar="FRACTIONS",
                          help="where the key sits in the filler (default 0.1,0.5,0.9)")
    evaluate.add_argument("--passkey-keys", type=int, default=1, metavar="K",
                          help="K > 1 adds the multi-key variant: K labelled keys in the prompt, one asked (max 8)")
    add_quantize_flag(evaluate, QUANTIZE_SCHEMES)
    add_common(evaluate)

    compress = commands.add_parser("compress", help="LatentLLM-style training-free low-rank compression")
    compress.add_argument("model")
    add_config_flags(compress, CompressConfig, required=("ratio",), skip=("options",))
    for options, methods in method_options().items():  # each method's own flags, in a group of their own
        add_config_flags(compress.add_argument_group(f"options of --method {', '.join(methods)}"), options)
    compress.add_argument("--calib", default="wiki-calib", help="calibration corpus (default wiki-calib)")
    compress.add_argument("--calib-samples", type=int, default=COMPRESS_CALIB_SAMPLES,
                          help=f"calibration blocks (default {COMPRESS_CALIB_SAMPLES})")
    compress.add_argument("--seq-len", type=int, default=512, help="calibration block length (default 512)")
    compress.add_argument("--measure-cost", action="store_true",
                          help="also time one plain forward over the calibration tokens (compression cost ratio)")
    compress.add_argument("--heal-tokens", type=int, default=0,
                          help="heal the compressed model with this many tokens of distillation from the original "
                               "(on --calib, blocks of --seq-len; other settings as `retrofitter heal`) before saving")
    compress.add_argument("--heal-minutes", type=float, default=0.0, help="time budget of that healing (minutes)")
    compress.add_argument("--out-of-core", action="store_true",
                          help="read the model one decoder layer at a time from its safetensors shards (models larger "
                               "than memory; --allocation uniform; no evaluation: run `retrofitter eval OUT`)")
    add_job_flags(compress)

    mla = commands.add_parser("mla", help="Multi-head Latent Attention (DeepSeek layout) by conversion: a small "
                              "latent k/v cache with one shared rotary key, absorbed execution (training-free; "
                              "--transfer-epochs trains each layer on the original model's attention output)")
    mla.add_argument("model")
    mla.add_argument("--preset", choices=sorted(MLA_PRESETS),
                     help="named recipe; explicit flags override it. " + "; ".join(
                         f"{name}: {p['description']}" for name, p in MLA_PRESETS.items()))
    add_config_flags(mla, MLAConfig)
    mla.add_argument("--calib", default="wiki-calib", help="calibration corpus (default wiki-calib)")
    mla.add_argument("--calib-samples", type=int, default=None,
                     help=f"calibration blocks (default {MLA_CALIB_SAMPLES}; the preset's with --preset)")
    mla.add_argument("--seq-len", type=int, default=None,
                     help=f"calibration block length (default {MLA_SEQ_LEN}; the preset's with --preset)")
    add_job_flags(mla)

    linearize = commands.add_parser("linearize", help="LoLCATs: hybrid window-softmax + linear attention, "
                                    "attention transfer then LoRA")
    linearize.add_argument("model")
    linearize.add_argument("--preset", choices=sorted(LINEARIZE_PRESETS),
                           help="named budget; explicit flags override it. " + "; ".join(
                               f"{name}: {p['description']}" for name, p in LINEARIZE_PRESETS.items()))
    add_config_flags(linearize, LinearizeConfig, skip=("grad_clip", "lora_dropout", "mix_init"),
                     choices={"feature_map": sorted(FEATURE_MAPS), "window_kind": sorted(WINDOW_KINDS),
                              "linear_weight": sorted(LINEAR_WEIGHTS)})
    linearize.add_argument("--train-corpus", default="wiki-calib", help="training text (default wiki-calib)")
    linearize.add_argument("--work-dir", type=Path, default=None,
                           help="block-wise transfer cache (default: next to --out; reused to resume)")
    linearize.add_argument("--eval-original", action="store_true", help="also evaluate the model before linearizing")
    add_job_flags(linearize)

    recall = commands.add_parser("recall", help="training-free recall for a linearized model: attention sinks, "
                                 "a sparse cache, softmax kept in the layers that matter for retrieval")
    recall.add_argument("model", help="a `retrofitter linearize` output")
    recall.add_argument("--sinks", type=int, default=4, help="first tokens always attended exactly (default 4)")
    recall.add_argument("--sparse-cache", type=int, default=0, metavar="M",
                        help="keys per layer and kv head the linear state recalls worst, attended exactly (LoLA)")
    recall.add_argument("--keep-softmax-top", type=int, default=0, metavar="K",
                        help="give softmax back to the K layers ranked first by --keep-softmax-by on retrieval probes")
    recall.add_argument("--keep-softmax-by", default="recall",
                        choices=RANKINGS,
                        help="recall: largest gain in the probes' answer likelihood (one forward per layer and probe); "
                             "retrieval: largest share of the original attention on the needle; reach: largest share "
                             "of it outside the window and sinks (one forward per probe); retrieval+reach: both in "
                             "turn")
    recall.add_argument("--probe-corpus", default="wiki-calib", help="text the retrieval probes hide keys in")
    recall.add_argument("--probe-count", type=int, default=4, help="retrieval probes of the ranking (default 4)")
    recall.add_argument("--probe-tokens", type=int, default=1024, help="length of each retrieval probe (default 1024)")
    add_job_flags(recall)

    heal = commands.add_parser("heal", help="distillation from the original model (LoRA, merged) that heals a "
                               "compressed or linearized model")
    heal.add_argument("model", help="a saved retrofitter directory (output of compress or linearize)")
    add_config_flags(heal, HealConfig)
    heal.add_argument("--teacher", default=None,
                      help="the original model (default: the source_model recorded in the directory)")
    heal.add_argument("--train-corpus", default="wiki-calib", help="training text (default wiki-calib)")
    heal.add_argument("--control", action="store_true",
                      help="also heal the original the same way and evaluate it (the control; ~1.0x by construction)")
    add_job_flags(heal)

    add_sample_command(commands)

    bench = commands.add_parser("bench", help="measured prefill latency, decode speed, cache bytes and memory")
    bench.add_argument("models", nargs="+", help="models to compare (first is the reference for ratios)")
    bench.add_argument("--prefill-len", type=int, default=512, help="prefill length in tokens (default 512)")
    bench.add_argument("--contexts", type=positive_int_list, default=(256, 1024, 4096),
                       help="comma-separated decode contexts (default 256,1024,4096)")
    bench.add_argument("--decode-tokens", type=int, default=32, help="timed greedy decode steps (default 32)")
    bench.add_argument("--repeats", type=int, default=3, help="timed repetitions per model (default 3)")
    bench.add_argument("--warmup", type=int, default=1, help="untimed warm-up repetitions (default 1)")
    bench.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    bench.add_argument("--compile", action="store_true",
                       help="framework overhead removed: a decode loop on static caches, eager and torch.compile'd "
                            "side by side, plus the overhead floor (docs/bench.md)")
    bench.add_argument("--batch-sizes", type=positive_int_list, default=(1,),
                       help="--compile: comma-separated batch sizes (default 1)")
    bench.add_argument("--no-floor", action="store_true", help="--compile: skip the overhead-floor model")
    bench.add_argument("--matvec", choices=MATVEC_CHOICES, default="auto",
                       help="--compile: a decode step's linear maps as BLAS calls or as fused reductions; auto "
                            "(default) measures which is faster per model and batch size on this machine")
    add_quantize_flag(bench, QUANTIZE_SCHEMES)
    add_common(bench)

    report = commands.add_parser("report", help="report.md + plots from results and bench JSONs in run dirs")
    report.add_argument("run_dirs", nargs="+", type=Path, help="directories holding *.json results (or JSON files)")
    report.add_argument("--out", type=Path, default=None, help="output directory (default: the first run dir)")

    export = commands.add_parser("export", help="write a model converted to MLA for other engines: a plain "
                                 "transformers DeepSeek-V3 directory (hf) or a llama.cpp GGUF (gguf)")
    export.add_argument("model", help="a retrofitter output directory (MLA), or any model for --format gguf")
    export.add_argument("--format", dest="fmt", choices=("hf", "gguf"), required=True)
    export.add_argument("--out", type=Path, required=True, help="output directory (hf) or .gguf file (gguf)")
    export.add_argument("--outtype", choices=("f32", "bf16"), default="f32", help="GGUF weight type (default f32)")
    export.add_argument("--overwrite", action="store_true", help="replace a previous export at --out")
    export.add_argument("--no-verify", action="store_true", help="skip the logits check of the written model")
    export.add_argument("--quiet", action="store_true")

    demo = commands.add_parser("demo", help="the main job on the default model: fetch, compress, eval, bench, report")
    demo.add_argument("--out", type=Path, default=Path("runs/demo"))
    demo.add_argument("--model", default="smollm2-135m")
    demo.add_argument("--ratios", default="0.1,0.2,0.3", help="asvd-rootcov ratios (one shared statistics pass)")
    demo.add_argument("--latentllm-ratios", default="",
                      help="also run latentllm (global fisher allocation, its own sequential pass) at these ratios")
    demo.add_argument("--mla-kv-ratios", default="0.25",
                      help="also convert the attention to MLA at these KV budgets ('' for none; the first is benched)")
    demo.add_argument("--max-eval-tokens", type=int, default=DEMO_MAX_EVAL_TOKENS, help="evaluation tokens per corpus")
    demo.add_argument("--calib-samples", type=int, default=DEMO_CALIB_SAMPLES,
                      help=f"calibration blocks of 512 tokens (default {DEMO_CALIB_SAMPLES})")
    demo.add_argument("--no-bench", action="store_true")
    demo.add_argument("--no-global", action="store_true",
                      help="skip the asvd-rootcov rows with global (fisher) rank allocation")
    demo.add_argument("--quiet", action="store_true")
    return parser


def cmd_fetch(args) -> int:
    from ..data.fetch import fetch

    for name, path in fetch(args.names, progress=not args.quiet, verify=True, force=args.force).items():
        print(f"{name}: {path}")
    return 0


def cmd_eval(args) -> int:
    from ..jobs import eval_job

    return show_results(eval_job(args.model, eval_config(args, args.seq_len), tasks=args.tasks, tasks_limit=args.tasks_limit,
                          passkey=args.passkey, passkey_trials=args.passkey_trials,
                          passkey_depths=args.passkey_depths, passkey_keys=args.passkey_keys, dtype=args.dtype,
                          device=args.device, quantize=args.quantize, progress=not args.quiet), args)


def cmd_compress(args) -> int:
    from ..jobs import compress_job

    config = compress_config_from_args(args)
    heal_config = None
    if args.heal_tokens or args.heal_minutes:
        heal_config = HealConfig(tokens=args.heal_tokens, minutes=args.heal_minutes, seq_len=args.seq_len)
    results = compress_job(args.model, args.out, config, eval_config(args, args.seq_len), calib=args.calib,
                           calib_samples=args.calib_samples, seq_len=args.seq_len, overwrite=args.overwrite,
                           measure_cost=args.measure_cost, dtype=args.dtype, device=args.device,
                           progress=not args.quiet, heal_config=heal_config, out_of_core=args.out_of_core)
    if results.get("rank", 0) != 0:  # another process of a torchrun launch: rank 0 reports
        return 0
    return show_results(results, args)


def cmd_mla(args) -> int:
    from ..jobs import mla_job

    preset = MLA_PRESETS[args.preset] if args.preset else {}
    calib_samples = (args.calib_samples if args.calib_samples is not None
                     else preset.get("calib_samples", MLA_CALIB_SAMPLES))
    seq_len = args.seq_len if args.seq_len is not None else preset.get("seq_len", MLA_SEQ_LEN)
    config = config_from_args(MLAConfig, args, base=preset.get("config"))
    # perplexity follows an explicit --seq-len (or --eval-seq-len), not a preset's calibration block length
    evaluation = eval_config(args, args.seq_len if args.seq_len is not None else MLA_SEQ_LEN)
    return show_results(mla_job(args.model, args.out, config, evaluation,
                         calib=args.calib, calib_samples=calib_samples, seq_len=seq_len,
                         overwrite=args.overwrite, dtype=args.dtype, device=args.device, progress=not args.quiet), args)


def cmd_export(args) -> int:
    from ..jobs import export_job

    record = export_job(args.model, args.out, args.fmt, outtype=args.outtype, overwrite=args.overwrite,
                        verify=not args.no_verify, progress=not args.quiet)
    parity = record.get("parity", {})
    check = f", logits max rel. error {parity['max_rel_error']:.1e}" if parity.get("checked") else ""
    architecture = record.get("gguf_architecture", record["architecture"])
    print(f"{record['format']} export ({architecture}{check}): {args.out}")
    return 0


def cmd_heal(args) -> int:
    from ..jobs import heal_job

    config = config_from_args(HealConfig, args)
    results = heal_job(args.model, args.out, config, eval_config(args, config.seq_len), teacher=args.teacher,
                       train_corpus=args.train_corpus, control=args.control, overwrite=args.overwrite,
                       dtype=args.dtype, device=args.device, progress=not args.quiet)
    if results.get("rank", 0) != 0:  # another process of a torchrun launch: rank 0 reports
        return 0
    return show_results(results, args)


def cmd_linearize(args) -> int:
    from ..jobs import linearize_job

    preset = LINEARIZE_PRESETS[args.preset] if args.preset else {}
    config = config_from_args(LinearizeConfig, args, base=preset.get("config"))
    if args.preset and args.max_eval_tokens is None:
        args.max_eval_tokens = preset["eval_max_tokens"]
    results = linearize_job(args.model, args.out, config, eval_config(args, config.seq_len), preset=args.preset,
                            train_corpus=args.train_corpus, work_dir=args.work_dir, eval_original=args.eval_original,
                            overwrite=args.overwrite, dtype=args.dtype, device=args.device, progress=not args.quiet)
    if results.get("rank", 0) != 0:  # another process of a torchrun launch: rank 0 reports
        return 0
    return show_results(results, args)


def cmd_recall(args) -> int:
    from ..jobs import recall_job

    return show_results(recall_job(args.model, args.out, sinks=args.sinks, sparse_cache=args.sparse_cache,
                            keep_softmax_top=args.keep_softmax_top,
                            keep_softmax_by=args.keep_softmax_by, probe_corpus=args.probe_corpus,
                            probe_tokens=args.probe_tokens, probe_count=args.probe_count,
                            eval_config=eval_config(args, 512), overwrite=args.overwrite, dtype=args.dtype,
                            device=args.device, progress=not args.quiet), args)


def cmd_bench(args) -> int:
    import torch

    from ..api import load_model, write_json
    from ..eval.bench import bench_models, unique_labels
    from ..eval.bench_table import format_bench_table

    if args.threads:
        torch.set_num_threads(args.threads)
    models = [(label, *load_model(name, dtype=args.dtype, device=args.device, quantize=args.quantize))
              for label, name in zip(unique_labels(args.models), args.models)]
    if args.compile:
        return _bench_compiled(args, models)
    bench = bench_models(models, prefill_len=args.prefill_len, contexts=args.contexts, decode_tokens=args.decode_tokens,
                         repeats=args.repeats, warmup=args.warmup, progress=not args.quiet)
    print(format_bench_table(bench))
    if args.json:
        write_json(bench, args.json)
    return 0


def _bench_compiled(args, models) -> int:
    """``bench --compile``: eager and compiled decode loops on static caches (eval/bench_decode.py)."""
    from ..api import write_json
    from ..eval.bench_decode import bench_decode
    from ..eval.bench_table import format_decode_table

    bench = bench_decode([(label, model) for label, model, _ in models], batch_sizes=args.batch_sizes,
                         contexts=args.contexts, prefill_len=args.prefill_len, decode_tokens=args.decode_tokens,
                         repeats=args.repeats, warmup=args.warmup, floor=not args.no_floor, matvec=args.matvec,
                         progress=not args.quiet)
    print(format_decode_table(bench))
    if args.json:
        write_json(bench, args.json)
    return 0


def cmd_report(args) -> int:
    from ..eval.report import write_report

    print(f"wrote {write_report(args.run_dirs, args.out)}")
    return 0


def cmd_demo(args) -> int:
    from ..demo import run_demo

    run_demo(out=args.out, model_name=args.model, ratios=tuple(float(r) for r in args.ratios.split(",") if r),
             latentllm_ratios=tuple(float(r) for r in args.latentllm_ratios.split(",") if r),
             max_eval_tokens=args.max_eval_tokens, calib_samples=args.calib_samples, bench=not args.no_bench,
             progress=not args.quiet, global_allocation=not args.no_global,
             mla_kv_ratios=tuple(float(r) for r in args.mla_kv_ratios.split(",") if r))
    return 0


COMMANDS = {"fetch": cmd_fetch, "eval": cmd_eval, "compress": cmd_compress, "mla": cmd_mla, "linearize": cmd_linearize,
            "recall": cmd_recall, "heal": cmd_heal, "sample": cmd_sample,
            "export": cmd_export, "bench": cmd_bench, "report": cmd_report, "demo": cmd_demo}


# Failures users cause (bad input, files, settings): one line naming the culprit. Anything else is a bug of
# ours: one line too, marked as internal, so a user never faces a raw traceback (--debug shows it).
USER_ERRORS = (RetrofitterError, ValueError, OSError, FloatingPointError)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    level = getattr(logging, args.log_level.upper(), logging.WARNING)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if level >= logging.WARNING:  # torchao's import chatter (transformers imports it): missing GPU kernels
        for noisy in ("torchao", "torch.utils._pytree"):
            logging.getLogger(noisy).setLevel(logging.ERROR)
    debug = args.debug or os.environ.get("RETROFITTER_DEBUG", "") not in ("", "0")
    try:
        if getattr(args, "json", None):
            args.json = check_json_output(args.json, input_paths(args))
        with quiet_libraries(getattr(args, "quiet", False)):
            return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print(f"retrofitter {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 — the one place that turns exceptions into messages
        if debug:
            traceback.print_exc()
        message = " ".join(str(error).split()) or type(error).__name__
        if not isinstance(error, USER_ERRORS):
            message = (f"internal error ({type(error).__name__}: {message}); rerun with --debug for the traceback "
                       f"and report it")
        print(f"retrofitter {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
