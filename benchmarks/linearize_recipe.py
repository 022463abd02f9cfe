"""LoLCATs stage-1 recipe search on the real model: transfer tokens, epochs, window, feature dimension, and
softmax kept in the layers with the largest transfer error.

Each variant is one attention transfer (stage 1 only, block-wise, ``--seq-len`` blocks of wiki-calib, no
LoRA) from the original model, then perplexity on wiki-eval at each ``--seq-lens`` (first
``--eval-tokens`` tokens). On the ``--restore-from`` variant the K worst layers (largest stage-1 MSE) are
then put back to softmax (``keep_softmax_top``; no retraining: the other layers are the same) and
evaluated for each K of ``--restore``. Stage 2 is left out: it is the same for every variant, and
stage 1 is what the variants change. A finished variant is skipped when the script runs again. Writes
a JSON, a Markdown table and a PNG (perplexity against stage-1 tokens).

    PYTHONPATH=src python benchmarks/linearize_recipe.py   # SmolLM2-135M: the six stage-1 runs took 36 min on 2 shared cores
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
from pathlib import Path

import torch

from retrofitter.api import evaluation_blocks, linearize, load_model, write_json
from retrofitter.config import LinearizeConfig
from retrofitter.data.blocks import token_blocks
from retrofitter.data.corpora import load_text
from retrofitter.eval.perplexity import perplexity
from retrofitter.pipelines.linearize import restore_worst_layers

from plotting import plot_ratio_curves

ROOT = Path(__file__).resolve().parents[1]
# name -> overrides of the cpu-small preset (stage 1 only); "tokens" is stage 1's token count
VARIANTS = {
    "w64-f64-8k": {"transfer_tokens": 8192, "transfer_epochs": 1},
    "w64-f64-16k": {"transfer_tokens": 16384, "transfer_epochs": 1},
    "w64-f64-32k": {"transfer_tokens": 32768, "transfer_epochs": 1},
    "w64-f64-16k-2ep": {"transfer_tokens": 16384, "transfer_epochs": 2},
    "w128-f64-16k": {"transfer_tokens": 16384, "transfer_epochs": 1, "window": 128},
    "w64-f128-16k": {"transfer_tokens": 16384, "transfer_epochs": 1, "feature_dim": 128},
}


def evaluate(model, tokenizer, seq_lens, max_tokens) -> dict:
    return {f"wiki-eval@{n}": perplexity(model, evaluation_blocks(tokenizer, "wiki-eval", n, max_tokens),
                                         batch_size=1, progress=False).ppl for n in seq_lens}


def format_markdown(results: dict) -> str:
    keys = [f"wiki-eval@{n}" for n in results["seq_lens"]]
    original = results["original"]
    lines = ["| variant | stage-1 tokens × epochs | window | feature dim | softmax layers | "
             + " | ".join(f"{k} (× original)" for k in keys) + " | stage-1 s |",
             "|---|---|---|---|---|" + "---|" * len(keys) + "---|",
             "| original | – | – | – | all | " + " | ".join(f"{original[k]:.2f}" for k in keys) + " | – |"]
    for name, row in results["variants"].items():
        cfg = row["config"]
        cells = " | ".join(f"{row['ppl'][k]:.2f} ({row['ppl'][k] / original[k]:.3f}×)" for k in keys)
        lines.append(f"| {name} | {cfg['transfer_tokens']} × {cfg['transfer_epochs']} | {cfg['window']} | "
                     f"{cfg['feature_dim']} | {row['softmax_layers'] or '–'} | {cells} | {row['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    series = {}
    for n in results["seq_lens"]:
        key = f"wiki-eval@{n}"
        series[f"seq {n}"] = sorted((row["config"]["transfer_tokens"], row["ppl"][key] / results["original"][key])
                                    for row in results["variants"].values()
                                    if row.get("curve") and row["config"]["transfer_epochs"] == 1)
    plot_ratio_curves(series, path, xlabel="stage-1 (attention transfer) tokens, 1 epoch",
                      ylabel="wiki-eval perplexity / original's (no stage 2)",
                      title="LoLCATs stage 1: window 64, feature dim 64")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    parser.add_argument("--restore-from", default="w64-f64-16k", help="variant whose worst layers get softmax back")
    parser.add_argument("--restore", default="2,4,6", help="numbers of layers given softmax back")
    parser.add_argument("--restore-keys", default="mse_after,relative_mse_after",
                        help="stage-1 errors that rank the layers: mse_after (what --keep-softmax-top uses) and/or "
                             "relative_mse_after (MSE over the teacher output's mean square)")
    parser.add_argument("--seq-len", type=int, default=2048, help="training block length")
    parser.add_argument("--seq-lens", default="512,2048", help="evaluation lengths")
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("runs/linearize-recipe"))
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/linearize_recipe.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    seq_lens = [int(n) for n in args.seq_lens.split(",")]
    results = json.loads(args.json.read_text()) if args.json.exists() else {}
    model, tokenizer = load_model(args.model)
    settings = {"model": args.model, "seq_len": args.seq_len, "seq_lens": seq_lens, "eval_tokens": args.eval_tokens,
                "threads": args.threads, "train_corpus": "wiki-calib", "eval_corpus": "wiki-eval",
                "base_preset": "cpu-small (stage 1 only: lora_tokens 0)"}
    if {k: results.get(k) for k in settings} != settings:
        results = {**settings, "variants": {}}
    if "original" not in results:
        results["original"] = evaluate(model, tokenizer, seq_lens, args.eval_tokens)
        write_json(results, args.json)
    print("original", results["original"], flush=True)
    text = load_text("wiki-calib")
    for name in args.variants.split(","):
        if name in results["variants"]:
            continue
        config = LinearizeConfig.preset("cpu-small", seq_len=args.seq_len, lora_tokens=0, **VARIANTS[name])
        blocks = token_blocks(tokenizer, text, args.seq_len, max_tokens=config.transfer_tokens)
        student, report = linearize(copy.deepcopy(model), config, blocks, None, progress=True,
                                    work_dir=args.work / name)
        shutil.rmtree(args.work / name, ignore_errors=True)  # the cached teacher inputs: ~70 KB per token
        errors = {int(k): v["mse_after"] for k, v in report["transfer"]["layers"].items()}
        row = {"config": config.to_dict(), "seconds": report["timings_s"]["transfer"], "softmax_layers": [],
               "curve": "-2ep" not in name and name.startswith("w64-f64"), "mse_after": errors,
               "ppl": evaluate(student, tokenizer, seq_lens, args.eval_tokens)}
        results["variants"][name] = row
        print(name, row["ppl"], f"{row['seconds']:.0f}s", flush=True)
        if name == args.restore_from:
            for key in args.restore_keys.split(","):
                for count in (int(k) for k in args.restore.split(",") if k):
                    restored = copy.deepcopy(student)
                    layers = restore_worst_layers(restored, report["transfer"]["layers"], count, key=key)
                    label = f"{name}+softmax{count}" + ("" if key == "mse_after" else f" ({key})")
                    results["variants"][label] = {
                        **row, "config": {**row["config"], "keep_softmax_top": count}, "softmax_layers": layers,
                        "ranked_by": key, "curve": False, "ppl": evaluate(restored, tokenizer, seq_lens, args.eval_tokens)}
                    print(label, layers, results["variants"][label]["ppl"], flush=True)
        write_json(results, args.json)
    args.json.with_suffix(".md").write_text(format_markdown(results))
    plot(results, args.json.with_suffix(".png"))
    print(format_markdown(results))


if __name__ == "__main__":
    main()
