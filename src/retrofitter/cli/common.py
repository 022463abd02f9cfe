"""What the commands share: the one-line argparse parser, common flags, the evaluation config, printing results."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config import EvalConfig
from .flags import name_list

__all__ = ["OneLineParser", "add_common", "add_quantize_flag", "add_eval_flags", "add_output_flags", "add_job_flags",
           "eval_config", "show_results"]


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``PROG: error: MESSAGE (see PROG --help)``, exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def add_common(parser, json_flag: bool = True) -> None:
    if json_flag:  # a string: a trailing "/" (a directory meant) must survive to be refused
        parser.add_argument("--json", help="write the results JSON here (a file; an existing one is replaced only "
                                           "if it holds a JSON object)")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def add_quantize_flag(parser, schemes) -> None:
    parser.add_argument("--quantize", choices=sorted(schemes), default=None,
                        help="quantize the projections after loading (torchao; embeddings and LM head stay float): "
                             + "; ".join(f"{name}: {s.description}" for name, s in schemes.items()))


def add_eval_flags(parser, flag: str, default: str) -> None:
    parser.add_argument(flag, dest="corpora", type=name_list, default=name_list(default),
                        help=f"comma-separated evaluation corpora (default {default}): built-in names, "
                             "a .txt file or directory, or hf:DATASET[:CONFIG][:SPLIT]")
    parser.add_argument("--eval-seq-len", type=int, default=None, help="perplexity window length (default: --seq-len)")
    parser.add_argument("--max-eval-tokens", type=int, default=None, help="cap on evaluation tokens per corpus")
    parser.add_argument("--eval-batch-size", type=int, default=4)


def add_output_flags(parser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="output directory (safetensors)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out once the new one is complete")
    parser.add_argument("--no-eval", action="store_true", help="skip the perplexity evaluation of the result")


def add_job_flags(parser) -> None:
    """What every command that writes a model takes: --out/--overwrite/--no-eval, the --eval corpora, common flags."""
    add_output_flags(parser)
    add_eval_flags(parser, "--eval", "wiki-eval")
    add_common(parser)


def eval_config(args, seq_len: int) -> EvalConfig:
    if getattr(args, "no_eval", False):
        return EvalConfig(corpora=())
    return EvalConfig(corpora=tuple(args.corpora), seq_len=args.eval_seq_len or seq_len,
                      max_eval_tokens=args.max_eval_tokens, batch_size=args.eval_batch_size)


def show_results(results: dict, args) -> int:
    from ..api import write_json
    from ..eval.table import format_results_table

    for task, metrics in results.get("lm_eval", {}).get("tasks", {}).items():
        print(f"lm-eval {task}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if v is not None))
    for key, name in (("passkey", "passkey retrieval"), ("multikey", "multi-key passkey")):
        if key in results:
            by_context = ", ".join(f"{n}: {a:.0%}" for n, a in results[key]["by_context"].items())
            print(f"{name}: {results[key]['accuracy']:.0%} ({by_context})")
    rows = [results[k] for k in ("original", "before") if k in results]
    print(format_results_table(rows + [results] + ([results["control"]] if "control" in results else [])))
    if args.json:
        write_json(results, args.json)
    return 0
