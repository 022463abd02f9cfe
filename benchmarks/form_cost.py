"""Factor forms chosen by cost, and a latency budget, measured (docs/compress.md, "Factor forms and a latency budget").

    python benchmarks/form_cost.py                   # SmolLM2-135M at ratio 0.3, 2 threads
    python benchmarks/form_cost.py --model runs/tiny --calib-blocks 2 --seq-len 64 --eval-tokens 256 \
        --prefill-len 64 --repeats 1                 # a quick check of the script on a small model

1. The micro-benchmark table (eval/form_cost.py, cached per machine): for each distinct projection shape
   of the model, the median time of y = f(x), x [prefill_len, d_in], dense and factored (plain, junction
   with gathered columns, junction with leading pivots) at a grid of ranks.
2. Two compressions at ``--ratio`` with ``--calib-blocks`` calibration blocks: ``--budget params``
   (the default: global fisher allocation priced in parameters, every matrix a junction) and
   ``--budget latency --factor-forms fastest`` (priced in modelled time at the uniform plan's time;
   matrices that run no faster factored stay dense).
3. Prefill latency of ``--prefill-len`` tokens (eval/bench.py ``bench_models``: the original and both
   compressed models interleaved, median of ``--repeats``) and perplexity on ``--eval-tokens`` of
   ``--eval-corpus``.

Writes OUT.json and prints the table: stored parameters of the compressed projections, modelled time
of the projections (cost model), measured prefill median and ratio to the original, perplexity.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn

from common import eval_blocks, machine_info, perplexities
from retrofitter.api import compress, load_model, write_json
from retrofitter.config import CompressConfig
from retrofitter.data.blocks import token_blocks
from retrofitter.data.corpora import load_text
from retrofitter.eval.bench import bench_models
from retrofitter.eval.cost_model import KERNELS, rank_grid
from retrofitter.eval.form_cost import measure_timings
from retrofitter.modules.latent_linear import LatentLinear, factor_form

VARIANTS = {"params": {}, "latency": {"budget": "latency", "factor_forms": "fastest"}}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--calib", default="wiki-calib")
    parser.add_argument("--calib-blocks", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512, help="calibration and evaluation block length")
    parser.add_argument("--eval-corpus", default="wiki-eval")
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--prefill-len", type=int, default=512,
                        help="tokens of the timed prefill and of the cost model")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/form_cost"), help="writes OUT.json")
    return parser.parse_args(argv)


def projection_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """Distinct (d_in, d_out) of the decoder's linear layers (every nn.Linear but the LM head)."""
    head = model.get_output_embeddings()
    return sorted({(m.in_features, m.out_features) for m in model.modules()
                   if isinstance(m, nn.Linear) and m is not head})


def timing_table(model: nn.Module, tokens: int):
    """(cost model, rows): one row per (shape, rank), milliseconds per kernel."""
    shapes = projection_shapes(model)
    weight = next(model.parameters())
    cost = measure_timings({shape: list(KERNELS) for shape in shapes}, tokens, weight.dtype, weight.device)
    rows = []
    for d_in, d_out in shapes:
        dense = cost.seconds(d_in, d_out, "dense")
        for rank in rank_grid(d_in, d_out):
            row = {"d_in": d_in, "d_out": d_out, "rank": rank, "dense_ms": dense * 1e3}
            for form, lead, name in (("plain", False, "plain"), ("junction", False, "junction_gather"),
                                     ("junction", True, "junction_slice")):
                row[f"{name}_ms"] = cost.seconds(d_in, d_out, form, rank, lead) * 1e3
            rows.append(row)
    return cost, rows


def modelled_ms(model: nn.Module, cost) -> float:
    """Modelled milliseconds of every decoder projection of ``model`` as it now runs (form, rank, pivot layout)."""
    head, total = model.get_output_embeddings(), 0.0
    for module in model.modules():
        if isinstance(module, LatentLinear):
            total += cost.seconds(module.in_features, module.out_features, factor_form(module), module.rank,
                                  module.pivots_lead())
        elif isinstance(module, nn.Linear) and module is not head:
            total += cost.seconds(module.in_features, module.out_features, "dense")
    return total * 1e3


def print_timing_table(rows: list[dict]) -> None:
    print(f"{'d_in':>5} {'d_out':>5} {'rank':>5} {'dense ms':>9} {'plain':>13} {'junction gather':>17} "
          f"{'junction slice':>16}")
    for row in rows:
        def cell(name, width):
            return f"{row[name]:7.3f} ({row[name] / row['dense_ms']:.2f}x)".rjust(width)
        print(f"{row['d_in']:>5} {row['d_out']:>5} {row['rank']:>5} {row['dense_ms']:9.3f} {cell('plain_ms', 13)} "
              f"{cell('junction_gather_ms', 17)} {cell('junction_slice_ms', 16)}")


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    original, tokenizer = load_model(args.model)
    results = {"model": args.model, "settings": vars(args) | {"out": str(args.out)}, "machine": machine_info(),
               "timings": [], "variants": {"original": {}}}
    t0 = time.perf_counter()
    cost, results["timings"] = timing_table(original, args.prefill_len)
    results["timing_table_s"] = time.perf_counter() - t0
    print_timing_table(results["timings"])
    calibration = token_blocks(tokenizer, load_text(args.calib), args.seq_len, max_blocks=args.calib_blocks)
    blocks = eval_blocks(tokenizer, [args.eval_corpus], args.seq_len, args.eval_tokens)
    models = [("original", original, tokenizer)]
    for label, overrides in VARIANTS.items():
        config = CompressConfig.from_flat(dict(ratio=args.ratio, latency_tokens=args.prefill_len, **overrides))
        student, _ = load_model(args.model)
        t0 = time.perf_counter()
        student, report = compress(student, config, calibration)
        forms = report.get("factor_forms", {})
        results["variants"][label] = {
            "config": config.to_dict(), "compress_s": time.perf_counter() - t0,
            "targets_params_before": report["targets_params_before"],
            "targets_params_after": report["targets_params_after"], "factor_forms": forms,
            "allocation": {k: v for k, v in report["allocation"].items() if k != "output_gradient_importance"}}
        models.append((label, student, tokenizer))
    bench = bench_models(models, prefill_len=args.prefill_len, contexts=(min(256, args.prefill_len),), decode_tokens=8,
                         repeats=args.repeats, warmup=args.warmup)
    results["bench"] = bench
    for (label, model, _), entry in zip(models, bench["models"]):
        record = results["variants"].setdefault(label, {})
        record["prefill_s"] = entry["prefill"]["latency_s"]["median"]
        record["prefill_ratio"] = entry["ratios"].get("prefill_latency")
        record["modelled_projections_ms"] = modelled_ms(model, cost)
        record["ppl"] = perplexities(model, blocks)[args.eval_corpus]
    write_json(results, args.out.with_suffix(".json"))
    print_summary(results)
    return 0


def print_summary(results: dict) -> None:
    original = results["variants"]["original"]
    print(f"\n{'model':<10} {'targets params':>15} {'modelled ms':>12} {'prefill ms':>11} {'ratio':>6} {'ppl':>8}"
          f"  forms")
    for label, record in results["variants"].items():
        forms = record.get("factor_forms") or {}
        params = record.get("targets_params_after", results["variants"]["params"]["targets_params_before"])
        print(f"{label:<10} {params:>15} {record['modelled_projections_ms']:12.2f} {record['prefill_s'] * 1e3:11.1f} "
              f"{record['prefill_s'] / original['prefill_s']:6.3f} {record['ppl']:8.3f}  {forms.get('counts', '')}")


if __name__ == "__main__":
    raise SystemExit(main())
