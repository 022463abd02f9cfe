"""Perplexity against KV-cache bytes per token: latentllm at one ratio under several ``--kv-ratio`` budgets.

Each point is the public command line (``retrofitter compress --method latentllm --kv-ratio K --json``),
run one after another with the same calibration; ``none`` is the run without a KV budget. The result
JSONs go to ``--out`` (a finished point is skipped when the script runs again), then ``retrofitter
report`` draws the frontier (plots/ppl_vs_kv_bytes.png) next to the original.

    python benchmarks/kv_frontier.py --ratio 0.3 --kv-ratios none,0.7,0.5,0.35 --calib-samples 16 \
        --out runs/kv_frontier --json benchmarks/results/kv_frontier.json   # 10 min per point on one free core
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cli_runner import ROOT, run_retrofitter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--kv-ratios", default="none,0.7,0.5,0.35")
    parser.add_argument("--calib-samples", type=int, default=16)
    parser.add_argument("--max-eval-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/kv_frontier"))
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "kv_frontier.json")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "log.txt"
    evaluation = ["--eval", "wiki-eval,austen", "--max-eval-tokens", str(args.max_eval_tokens), "--quiet"]
    if not (args.out / "original.json").exists():
        run_retrofitter(["eval", args.model, "--ppl", "wiki-eval,austen", "--max-eval-tokens", str(args.max_eval_tokens),
                     "--quiet", "--json", str(args.out / "original.json")], threads=args.threads, log=log)
    points = {}
    for kv in args.kv_ratios.split(","):
        result = args.out / f"latentllm-{args.ratio:g}-kv-{kv}.json"
        if not result.exists():
            budget = [] if kv == "none" else ["--kv-ratio", kv]
            run_retrofitter(["compress", args.model, "--method", "latentllm", "--ratio", str(args.ratio), *budget,
                         "--calib-samples", str(args.calib_samples), "--out", str(args.out / f"model-kv-{kv}"),
                         "--overwrite", *evaluation, "--json", str(result)], threads=args.threads, log=log)
        record = json.loads(result.read_text())
        points[kv] = {"ppl": record["ppl"], "kv_bytes_per_token": record["kv_bytes_per_token"],
                      "params_total": record["params"]["total"], "compress_s": record["timings_s"].get("compress")}
    run_retrofitter(["report", str(args.out), "--out", str(args.out / "report")], threads=args.threads, log=log)
    original = json.loads((args.out / "original.json").read_text())
    summary = {"model": args.model, "method": "latentllm", "ratio": args.ratio, "calib_samples": args.calib_samples,
               "max_eval_tokens": args.max_eval_tokens, "threads": args.threads,
               "original": {"ppl": original["ppl"], "kv_bytes_per_token": original["kv_bytes_per_token"]},
               "points": points, "plot": str(args.out / "report" / "plots" / "ppl_vs_kv_bytes.png")}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
