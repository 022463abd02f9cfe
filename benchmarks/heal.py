"""Healing a compressed model by distillation: original -> compressed -> healed, and the control.

Stages (perplexity on each ``--corpora`` at ``--seq-len``, ``--eval-tokens`` tokens each):

1. original;
2. compressed at ``--ratio`` with the default compression (asvd-rootcov, global fisher allocation,
   teacher statistics; ``--statistics`` overrides; ``--compressed DIR`` reuses a saved one, else it is
   saved to ``--work/compressed`` so a rerun skips the compression);
3. healed: LoRA distillation from the original (``retrofitter.heal``) for ``--minutes`` of training
   and/or ``--tokens`` tokens of ``--train-corpus``;
4. control: the original given the same distillation (the tokens the heal used): ≈ 1.0x by construction.

The JSON is rewritten after every stage (an interrupted run keeps its rows); the Markdown table is
written at the end. Healing is resumable through ``--work/heal`` (rerun the same command).

    PYTHONPATH=src python benchmarks/heal.py --minutes 10            # compress + 10 min heal + 10 min control + evals
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from common import eval_blocks, machine_info, output_path, perplexities
from retrofitter.api import compress, heal, load, load_model, save, write_json
from retrofitter.config import CompressConfig, HealConfig
from retrofitter.data.blocks import token_blocks
from retrofitter.data.corpora import load_text
from retrofitter.eval.resources import peak_rss_mb


def training_blocks(tokenizer, corpus: str, config: HealConfig) -> torch.Tensor:
    """Blocks of the training text: the token budget's worth, or the whole text for a time budget alone."""
    max_tokens = max(config.tokens, config.seq_len) if config.tokens and not config.minutes else None
    return token_blocks(tokenizer, load_text(corpus), config.seq_len, max_tokens=max_tokens)


def markdown(results: dict) -> str:
    original = results["ppl"]["original"]
    lines = [f"Model {results['model']}; compress {results['compress']['method']} at {results['compress']['ratio']} "
             f"(allocation {results['compress']['allocation']}, {results['compress']['allocation_weighting']}, "
             f"statistics {results['compress']['statistics']}); heal: {results['heal'].get('steps')} steps, "
             f"{results['heal'].get('tokens')} tokens of {results['train_corpus']} in "
             f"{results['heal'].get('seconds', 0):.0f} s ({results['threads']} threads); eval "
             f"{results['eval_tokens']} tokens per corpus at seq {results['seq_len']}.", "",
             "| stage | " + " | ".join(f"ppl {c}" for c in original) + " | " + " | ".join(f"x {c}" for c in original)
             + " |", "|---|" + "---|" * (2 * len(original))]
    for stage, row in results["ppl"].items():
        lines.append(f"| {stage} | " + " | ".join(f"{row[c]:.2f}" for c in original) + " | "
                     + " | ".join(f"{row[c] / original[c]:.3f}" for c in original) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--compressed", type=Path, default=None, help="a saved compressed model to start from")
    parser.add_argument("--calib", default="wiki-calib")
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--statistics", default=None, help="CompressConfig.statistics (default: the method's default)")
    parser.add_argument("--train-corpus", default="wiki-calib")
    parser.add_argument("--corpora", default="wiki-eval,austen")
    parser.add_argument("--seq-len", type=int, default=512, help="evaluation, calibration and training block length")
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--minutes", type=float, default=10.0, help="heal time budget (0: --tokens alone)")
    parser.add_argument("--tokens", type=int, default=0, help="heal token budget (0: --minutes alone)")
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--lora-rank", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--nll-weight", type=float, default=None)
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="recompute decoder layers in backward (less memory, ~20%% fewer steps per minute; "
                             "off here: at seq 512 a 135M model's activations take well under 1 GB)")
    parser.add_argument("--no-control", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("runs/heal-bench"), help="compressed model + heal work dir")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/heal"), help="writes OUT.json, OUT.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    overrides = {k: v for k, v in {"lr": args.lr, "lora_rank": args.lora_rank, "batch_size": args.batch_size,
                                   "nll_weight": args.nll_weight}.items() if v is not None}
    heal_config = HealConfig(tokens=args.tokens, minutes=args.minutes, seq_len=args.seq_len,
                             gradient_checkpointing=args.gradient_checkpointing, **overrides)
    # the default compression (asvd-rootcov, global fisher allocation, teacher statistics); --statistics
    # teacher_target is the best training-free fit but ~10x the compression time for ~1 % perplexity
    compress_config = CompressConfig(ratio=args.ratio, statistics=args.statistics)
    corpora = [c for c in args.corpora.split(",") if c]
    json_path, md_path = output_path(args.out, ".json"), output_path(args.out, ".md")
    original, tokenizer = load_model(args.model)
    blocks = eval_blocks(tokenizer, corpora, args.seq_len, args.eval_tokens)
    results = {"model": args.model, "compress": compress_config.to_dict(), "heal_config": heal_config.to_dict(),
               "train_corpus": args.train_corpus, "seq_len": args.seq_len, "eval_tokens": args.eval_tokens,
               "threads": args.threads, "machine": machine_info(), "ppl": {}, "timings_s": {}, "heal": {}}
    results["ppl"]["original"] = perplexities(original, blocks)
    write_json(results, json_path)

    compressed_dir = args.compressed or args.work / "compressed"
    if (compressed_dir / "retrofitter.json").is_file():
        student, _ = load(compressed_dir)
        results["compressed_from"] = str(compressed_dir)
    else:
        student, _ = load_model(args.model)
        calibration = token_blocks(tokenizer, load_text(args.calib), args.seq_len, max_blocks=args.calib_samples)
        start = time.perf_counter()
        student, _ = compress(student, compress_config, calibration, checkpoint_dir=args.work / "compress-partial")
        results["timings_s"]["compress"] = time.perf_counter() - start
        save(student, compressed_dir, tokenizer=tokenizer, metadata={"method": compress_config.method,
             "ratio": args.ratio, "source_model": args.model, "config": compress_config.to_dict()})
    results["ppl"]["compressed"] = perplexities(student, blocks)
    write_json(results, json_path)

    train = training_blocks(tokenizer, args.train_corpus, heal_config)
    student, report = heal(student, original, train, heal_config, work_dir=args.work / "heal")
    results["heal"] = {k: v for k, v in report.items() if k != "config"}
    results["ppl"]["healed"] = perplexities(student, blocks)
    results["peak_rss_mb"] = peak_rss_mb()
    write_json(results, json_path)

    if not args.no_control and report["tokens"]:
        control, _ = load_model(args.model)
        same = dataclasses.replace(heal_config, tokens=report["tokens"], minutes=0.0)
        control, control_report = heal(control, original, train, same, work_dir=args.work / "control")
        results["control_heal"] = {k: v for k, v in control_report.items() if k not in ("config", "loss_history")}
        results["ppl"]["control (original healed)"] = perplexities(control, blocks)
        write_json(results, json_path)
    md_path.write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
