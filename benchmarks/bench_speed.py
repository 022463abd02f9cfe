"""Measured speed and memory of saved models side by side (compresses nothing itself).

    python benchmarks/bench_speed.py                      # smollm2-135m vs runs/bench/asvd-rootcov-0.3 if present
    python benchmarks/bench_speed.py smollm2-135m runs/x  # any models load_model accepts; the first is the reference
    python benchmarks/bench_speed.py --contexts 256,1024 --decode-tokens 16   # quicker first try on a small CPU

Writes benchmarks/results/bench_speed.json (``"kind": "bench"``; ``retrofitter report`` reads it) and
prints the table: median, min–max and ratio vs the first model for prefill latency, decode
tokens/s per context, measured cache bytes, accounting KV bytes/token and peak memory.
See docs/bench.md for what is measured and how.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from retrofitter.api import load_model, write_json
from retrofitter.eval.bench import bench_models, unique_labels
from retrofitter.eval.bench_table import format_bench_table

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_REFERENCE = "smollm2-135m"
DEFAULT_CANDIDATE = ROOT / "runs" / "bench" / "asvd-rootcov-0.3"
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "bench_speed.json"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", help=f"models to compare (default: {DEFAULT_REFERENCE} and "
                                                  f"{DEFAULT_CANDIDATE.relative_to(ROOT)} when it exists)")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--contexts", type=_ints, default=(256, 1024, 4096))
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, default=DEFAULT_OUTPUT)
    return parser.parse_args(argv)


def default_models() -> list[str]:
    models = [DEFAULT_REFERENCE]
    if DEFAULT_CANDIDATE.is_dir():
        models.append(str(DEFAULT_CANDIDATE))
    else:
        print(f"note: {DEFAULT_CANDIDATE.relative_to(ROOT)} not found; benching {DEFAULT_REFERENCE} alone "
              f"(make it with: retrofitter compress {DEFAULT_REFERENCE} --ratio 0.3 --out {DEFAULT_CANDIDATE.relative_to(ROOT)})")
    return models


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.models or default_models()
    models = [(label, *load_model(name, dtype=args.dtype, device=args.device))
              for label, name in zip(unique_labels(names), names)]
    bench = bench_models(models, prefill_len=args.prefill_len, contexts=args.contexts,
                         decode_tokens=args.decode_tokens, repeats=args.repeats, warmup=args.warmup, progress=True)
    print(format_bench_table(bench))
    write_json(bench, args.json)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
