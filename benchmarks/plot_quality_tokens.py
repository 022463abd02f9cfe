"""Tokens against perplexity for the window-128 LoLCATs recipe (the `quality` preset's settings).

Reads the stored runs, trains nothing:
  linearize_recipe.json       w128-f64-16k: stage 1 only, 16k tokens x 1 epoch
  linearize_quality.json      48k x 2 transfer + 24k KL LoRA tokens (`quality` before 2026-12)
  linearize_quality_96k.json  96k x 2 transfer + 48k KL LoRA tokens (`--preset quality`)
x = stage-1 optimizer tokens (transfer tokens x epochs); y = wiki-eval perplexity / the original's, after
stage 1 and after stage 2, at seq 512 and 2048. Writes benchmarks/results/linearize_quality_tokens.png and
prints the points.

    python benchmarks/plot_quality_tokens.py
"""

from __future__ import annotations

import json
from pathlib import Path

from plotting import plot_ratio_curves

RESULTS = Path(__file__).parent / "results"


def points() -> dict[str, list[tuple[float, float]]]:
    """Series label -> sorted (stage-1 optimizer tokens, perplexity / original's)."""
    recipe = json.loads((RESULTS / "linearize_recipe.json").read_text())
    runs = [json.loads((RESULTS / name).read_text()) for name in ("linearize_quality.json", "linearize_quality_96k.json")]
    series: dict[str, list[tuple[float, float]]] = {}
    for n in (512, 2048):
        key = f"wiki-eval@{n}"
        row = recipe["variants"]["w128-f64-16k"]
        stage1 = [(row["config"]["transfer_tokens"] * row["config"]["transfer_epochs"],
                   row["ppl"][key] / recipe["original"][key])]
        stage2 = []
        for run in runs:
            tokens = run["config"]["transfer_tokens"] * run["config"]["transfer_epochs"]
            ppl = run["ppl_by_stage"]
            stage1.append((tokens, ppl["transfer"][key] / ppl["original"][key]))
            stage2.append((tokens, ppl["lora"][key] / ppl["original"][key]))
        series[f"after stage 1, seq {n}"] = sorted(stage1)
        series[f"after stage 2 (LoRA tokens = transfer / 2), seq {n}"] = sorted(stage2)
    return series


def main() -> None:
    series = points()
    for label, pts in series.items():
        print(label + ": " + ", ".join(f"{int(x)} -> {y:.3f}x" for x, y in pts))
    out = RESULTS / "linearize_quality_tokens.png"
    plot_ratio_curves(series, out, xlabel="stage-1 optimizer tokens (transfer tokens x epochs)",
                      ylabel="wiki-eval perplexity / original's",
                      title="LoLCATs, window 128, feature dim 64, KL stage 2")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
