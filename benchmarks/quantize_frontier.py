"""Quantization × compression: perplexity against weight bytes on the default model, one run.

Rows (SmolLM2-135M unless --model):

* the original in fp32, bf16, and quantized with each ``--schemes`` (torchao int8, ``retrofitter.api.quantize``:
  every decoder projection; embeddings and the tied LM head stay fp32);
* asvd-rootcov at each ``--ratios`` (uniform ranks, one shared teacher-statistics pass over
  ``--calib-samples`` blocks of 512 tokens of wiki-calib, as ``retrofitter demo`` does) in fp32 and
  quantized with each scheme (the LatentLinear factors ``up``, ``mix`` become int8).

Perplexity on wiki-eval and austen (windows of ``--seq-len`` tokens, ``--max-eval-tokens`` per corpus:
``common.eval_blocks``). Weight bytes = ``eval.accounting.stored_bytes``: every state-dict tensor once,
an int8 weight [n, k] as its n·k int8 values + n fp32 scales + n int8 zero points; "layers" = the part
inside the decoder layers (the embeddings, ~113 MB in fp32, are the same in every row). A row is on the
frontier when no other row has fewer-or-equal bytes and a lower perplexity on every corpus.

    python benchmarks/quantize_frontier.py                # full run: ~15 min on 2 CPU cores
    python benchmarks/quantize_frontier.py --ratios 0.3 --max-eval-tokens 512 --calib-samples 4 \\
        --out /tmp/quantize_frontier_smoke                 # smoke test, a few minutes

Writes OUT.json, OUT.md and OUT.png (default OUT = benchmarks/results/quantize_frontier).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import time
from pathlib import Path

import torch

from common import eval_blocks, machine_info, perplexities
from retrofitter.api import compress_from_statistics, load_model, quantize, teacher_statistics, write_json
from retrofitter.config import CompressConfig
from retrofitter.data.blocks import calibration_blocks
from retrofitter.data.corpora import load_text
from retrofitter.eval.accounting import stored_bytes, tensor_bytes


def layer_bytes(model) -> int:
    """Bytes of the state-dict tensors inside decoder layers (``.layers.`` in the name), each tensor once."""
    unique = {id(t): t for name, t in model.state_dict(keep_vars=True).items() if ".layers." in name}
    return sum(tensor_bytes(t) for t in unique.values())


def measure(label, method, ratio, precision, model, blocks, batch_size) -> dict:
    t0 = time.perf_counter()
    ppl = perplexities(model, blocks, batch_size)
    return {"label": label, "method": method, "ratio": ratio, "precision": precision, "ppl": ppl,
            "bytes": {"stored": stored_bytes(model), "layers": layer_bytes(model)},
            "eval_seconds": time.perf_counter() - t0}


def mark_frontier(rows, corpora) -> None:
    """``frontier``: no other row has bytes ≤ and perplexity < on every corpus; ``dominated_by``: those rows."""
    for r in rows:
        better = [o["label"] for o in rows if o is not r and o["bytes"]["stored"] <= r["bytes"]["stored"]
                  and all(o["ppl"][c] < r["ppl"][c] for c in corpora)]
        r["frontier"], r["dominated_by"] = not better, better


def markdown(rows, corpora) -> str:
    head = ["model", "precision", *[f"ppl {c}" for c in corpora], "weights MiB", "layers MiB", "eval s", "frontier"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ppl = [f"{r['ppl'][c]:.2f}" if r["ppl"][c] < 1e4 else f"{r['ppl'][c]:.3g}" for c in corpora]
        frontier = "yes" if r.get("frontier") else "no (" + ", ".join(r.get("dominated_by", [])) + ")"
        lines.append("| " + " | ".join([r["label"].rsplit(" ", 1)[0], r["precision"], *ppl,
                                        f"{r['bytes']['stored'] / 2**20:.1f}", f"{r['bytes']['layers'] / 2**20:.1f}",
                                        f"{r['eval_seconds']:.0f}", frontier]) + " |")
    return "\n".join(lines)


def comparisons(rows, corpora, schemes) -> list[str]:
    """Each compressed + int8 row against the int8 original: bytes and perplexity change."""
    lines = []
    for scheme in schemes:
        base = next((r for r in rows if r["method"] == "original" and r["precision"] == scheme), None)
        for r in rows:
            if base is None or r["method"] == "original" or r["precision"] != scheme:
                continue
            ppl = ", ".join(f"{c} {r['ppl'][c] / base['ppl'][c] - 1:+.1%}" for c in corpora)
            lines.append(f"* {r['label']} vs original {scheme}: weight bytes "
                         f"{r['bytes']['stored'] / base['bytes']['stored'] - 1:+.1%}, perplexity {ppl}")
    return lines


def plot(rows, corpora, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda value, _: f"{value:g}")  # 30, 40 rather than 3×10^1

    fig, axes = plt.subplots(1, len(corpora), figsize=(6 * len(corpora), 4.6), squeeze=False)
    precisions = list(dict.fromkeys(r["precision"] for r in rows))
    for ax, corpus in zip(axes[0], corpora):
        for i, precision in enumerate(precisions):
            series = sorted((r for r in rows if r["precision"] == precision), key=lambda r: r["bytes"]["stored"])
            xs = [r["bytes"]["stored"] / 2**20 for r in series]
            ys = [r["ppl"][corpus] for r in series]
            ax.plot(xs, ys, marker="osD^v"[i % 5], label=precision, linestyle="-" if len(series) > 1 else "none")
            for r, x, y in zip(series, xs, ys):
                ax.annotate("orig" if r["ratio"] is None else f"{r['ratio']:g}", (x, y), fontsize=7,
                            textcoords="offset points", xytext=(4, 4))
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_xlabel("weight bytes (MiB, state dict)")
        ax.set_ylabel(f"perplexity {corpus} (log)")
        ax.set_title(corpus)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("perplexity vs weight bytes: original / asvd-rootcov ratio × precision")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(args, rows, corpora, schemes, blocks, started, final=False) -> None:
    """(Re)write JSON and markdown after every row (an interrupted run keeps its rows); the plot at the end."""
    mark_frontier(rows, corpora)
    settings = {"model": args.model, "calib": "wiki-calib", "calib_samples": args.calib_samples,
                "calib_seq_len": 512, "seq_len": args.seq_len, "eval": corpora,
                "max_eval_tokens": args.max_eval_tokens, "eval_tokens": {c: int(b.numel()) for c, b in blocks.items()},
                "ratios": [float(r) for r in args.ratios.split(",") if r], "schemes": schemes,
                "allocation": "uniform", "statistics": "teacher",
                "threads": torch.get_num_threads(), "cpu": machine_info()["cpu"], "torch": torch.__version__,
                "date": datetime.date.today().isoformat(), "wall_seconds": time.perf_counter() - started}
    write_json({"kind": "quantize_frontier", "settings": settings, "rows": rows}, args.out.with_suffix(".json"))
    text = (f"Measured {settings['date']} on {settings['cpu']} ({settings['threads']} threads); {args.model}; "
            f"asvd-rootcov, uniform ranks, teacher statistics of wiki-calib {args.calib_samples}×512; eval seq "
            f"{args.seq_len}, {args.max_eval_tokens} tokens per corpus. Weights = state-dict bytes (int8: values + "
            f"fp32 scales + int8 zero points); layers = the decoder layers' share (embeddings and the tied head "
            f"stay fp32 in every row).\n\n{markdown(rows, corpora)}\n\n"
            + "\n".join(comparisons(rows, corpora, schemes)) + "\n")
    args.out.with_suffix(".md").write_text(text)
    if final:
        plot(rows, corpora, args.out.with_suffix(".png"))
        print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--ratios", default="0.1,0.2,0.3")
    parser.add_argument("--schemes", default="int8-weight",
                        help="comma-separated quantize schemes (api.QUANTIZE_SCHEMES)")
    parser.add_argument("--calib-samples", type=int, default=32, help="calibration blocks of 512 tokens (default 32)")
    parser.add_argument("--seq-len", type=int, default=512, help="evaluation window (default 512)")
    parser.add_argument("--eval", default="wiki-eval,austen")
    parser.add_argument("--max-eval-tokens", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/quantize_frontier"))
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ratios = [float(r) for r in args.ratios.split(",") if r]
    schemes = [s for s in args.schemes.split(",") if s]
    corpora = [c for c in args.eval.split(",") if c]

    started = time.perf_counter()
    original, tokenizer = load_model(args.model)
    blocks = eval_blocks(tokenizer, corpora, args.seq_len, args.max_eval_tokens)
    rows = []

    def add(label, method, ratio, precision, model):
        rows.append(measure(label, method, ratio, precision, model, blocks, args.batch_size))
        write_results(args, rows, corpora, schemes, blocks, started)
        print(markdown(rows[-1:], corpora).splitlines()[-1], flush=True)  # frontier among the rows so far

    add("original fp32", "original", None, "fp32", original)
    add("original bf16", "original", None, "bf16", copy.deepcopy(original).to(torch.bfloat16))
    for scheme in schemes:
        add(f"original {scheme}", "original", None, scheme, quantize(copy.deepcopy(original), scheme))

    calibration = calibration_blocks(tokenizer, load_text("wiki-calib"), 512, args.calib_samples)
    moments = teacher_statistics(original, calibration, progress=False)
    svd_cache: dict = {}  # one weighted SVD per matrix, truncated at every ratio
    for ratio in ratios:
        model = copy.deepcopy(original)
        compress_from_statistics(model, CompressConfig(ratio=ratio, statistics="teacher", allocation="uniform"), moments, svd_cache)
        add(f"asvd-rootcov-{ratio:g} fp32", "asvd-rootcov", ratio, "fp32", model)
        for scheme in schemes:
            quantized = quantize(copy.deepcopy(model), scheme)
            add(f"asvd-rootcov-{ratio:g} {scheme}", "asvd-rootcov", ratio, scheme, quantized)
            del quantized
        del model
    write_results(args, rows, corpora, schemes, blocks, started, final=True)


if __name__ == "__main__":
    main()
