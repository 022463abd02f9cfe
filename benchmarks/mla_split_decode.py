"""A CPU decode step of an MLA model with its cache split across threads (flash-decoding) against the same model
with the split off, beside the original, interleaved (``eval.bench_decode``: static caches, medians of the step time).

The split (``ops/decode_attention.py``) runs under sdpa on CPU; the other copy of the MLA model runs every step
through SDPA's fused kernel as one head of h query rows, which that kernel runs on one thread.

    python benchmarks/mla_split_decode.py smollm2-135m runs/mla-0.25 --contexts 4096,8192 --repeats 5 --threads 2

Writes --json (default benchmarks/results/mla_split_decode.json) and prints the step times and ratios.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from retrofitter.api import load_model, write_json
from retrofitter.eval.bench_decode import bench_decode
from retrofitter.modules.mla_attention import MLAAttention

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("original")
    parser.add_argument("mla", help="a saved MLA model (retrofitter mla)")
    parser.add_argument("--contexts", default="4096,8192")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "mla_split_decode.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    original = load_model(args.original)[0].eval()
    split, unsplit = (load_model(args.mla)[0].eval() for _ in range(2))
    modules = [m for m in unsplit.modules() if isinstance(m, MLAAttention)]
    if not modules:
        raise SystemExit(f"{args.mla} has no MLA attention")
    for module in modules:
        module.split_cpu_decode = False  # the resolved kernel (sdpa) runs every step
    result = bench_decode([("original", original), ("mla split", split), ("mla unsplit", unsplit)],
                          modes=args.modes.split(","), contexts=[int(n) for n in args.contexts.split(",")],
                          prefill_len=0, decode_tokens=args.decode_tokens, repeats=args.repeats, floor=False,
                          progress=True)
    write_json({"settings": vars(args) | {"json": str(args.json)}, "bench_decode": result}, args.json)
    for mode, by_batch in result["results"].items():
        entries = by_batch["1"]
        for label, entry in entries.items():
            unsplit = entries["mla unsplit"]["decode"]
            print(f"{mode:<9} {label:<12} " + "  ".join(
                f"@{n} {d['step_s']['median'] * 1e3:7.2f} ms "
                f"(x{entry['ratios']['decode'][n]['step']:.3f} the original, "
                f"x{d['step_s']['median'] / unsplit[n]['step_s']['median']:.3f} unsplit)"
                for n, d in entry["decode"].items()))


if __name__ == "__main__":
    main()
