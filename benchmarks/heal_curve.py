"""Perplexity against healing tokens: one ``retrofitter heal`` per token budget, from the same compressed model.

Each budget is its own run (its own warm-up and cosine schedule, as a user with that budget would run
it), through the public command line, evaluated on wiki-eval and austen. A finished budget is skipped
when the script runs again. Writes a JSON, a Markdown table and a PNG (perplexity over the original's,
against tokens, log x).

    python benchmarks/heal.py --minutes 10                    # makes runs/heal-bench/compressed once
    python benchmarks/heal_curve.py --compressed runs/heal-bench/compressed --tokens 5120,10240,20480,40960,81920
    # SmolLM2-135M at 0.2, seq 512, 2 threads: ~5.5 s per 512-token step, ~35 min for these budgets
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cli_runner import ROOT, run_retrofitter
from plotting import plot_ratio_curves


def plot(rows: list[dict], original: dict, path: Path) -> None:
    series = {corpus: [(r["tokens"], r["ppl"][corpus] / reference) for r in rows] for corpus, reference in original.items()}
    plot_ratio_curves(series, path, xlabel="healing tokens (log scale; 0 = before healing shown at the left end)",
                      ylabel="perplexity / original's", title="Healing: perplexity against distillation tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compressed", type=Path, default=Path("runs/heal-bench/compressed"))
    parser.add_argument("--tokens", default="5120,10240,20480,40960,81920")
    parser.add_argument("--max-eval-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("runs/heal-curve"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "heal_curve",
                        help="writes OUT.json, OUT.md, OUT.png")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    log = args.work / "log.txt"
    budgets = [int(t) for t in args.tokens.split(",")]
    evaluation = ["--eval", "wiki-eval,austen", "--max-eval-tokens", str(args.max_eval_tokens), "--quiet"]
    rows, seconds = [], {}
    for tokens in budgets:
        result = args.work / f"heal-{tokens}.json"
        if not result.exists():
            seconds[tokens] = run_retrofitter(["heal", str(args.compressed), "--tokens", str(tokens), "--out",
                                               str(args.work / f"healed-{tokens}"), "--overwrite", *evaluation,
                                               "--json", str(result)], threads=args.threads, log=log)
        record = json.loads(result.read_text())
        rows.append({"tokens": record["heal"]["tokens"], "steps": record["heal"]["steps"],
                     "seconds": record["heal"]["seconds"], "ppl": record["ppl"]})
    first = json.loads((args.work / f"heal-{budgets[0]}.json").read_text())
    original, before = first["original"]["ppl"], first["before"]["ppl"]
    rows.insert(0, {"tokens": 0, "steps": 0, "seconds": 0.0, "ppl": before})
    corpora = sorted(original)
    lines = ["| heal tokens | steps | train s | " + " | ".join(f"{c} (× original)" for c in corpora) + " |",
             "|---|---|---|" + "---|" * len(corpora)]
    for row in rows:
        cells = [f"{row['ppl'][c]:.2f} ({row['ppl'][c] / original[c]:.3f}×)" for c in corpora]
        lines.append(f"| {row['tokens']} | {row['steps']} | {row['seconds']:.0f} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    summary = {"compressed": str(args.compressed), "original": original, "rows": rows, "threads": args.threads,
               "max_eval_tokens": args.max_eval_tokens, "settings": first.get("heal", {}).get("config")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=2))
    args.out.with_suffix(".md").write_text(table + "\n")
    plot([{**r, "tokens": max(r["tokens"], budgets[0] // 2)} for r in rows], original, args.out.with_suffix(".png"))
    print(table)


if __name__ == "__main__":
    main()
