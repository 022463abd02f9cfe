"""How fast a CPU reads weights in a matrix-vector product: ``F.linear`` (MKL on the CPU wheel) against the fused
reduction of ``ops/matvec.py`` compiled by inductor, beside a streaming sum as the memory's own rate.

For each dtype, shape [d_out, d] and row count b: ``--count`` distinct random weights (more bytes than the last-level
cache, so every pass reads them from memory), one pass applies each to a random [b, d] input; GB/s = weight bytes of a
pass / its median time over ``--repeats`` interleaved passes (after one untimed pass, which also compiles).

    python benchmarks/matvec_bandwidth.py --threads 2

Writes --json (default benchmarks/results/matvec_bandwidth.json) and prints one line per case.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from retrofitter.api import write_json
from retrofitter.eval.bench import machine_info
from retrofitter.ops.matvec import matvec_reduction

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ((1536, 576), (576, 1536), (49152, 576))  # SmolLM2-135M: gate/up, down, the LM head


def _blas(xs, ws):
    return [F.linear(x, w) for x, w in zip(xs, ws)]


def _reduction(xs, ws):
    return [matvec_reduction(x, w) for x, w in zip(xs, ws)]


def _passes(runs: dict, args, xs, ws) -> dict:
    times = {name: [] for name in runs}
    for repetition in range(args.repeats + 1):
        for name, run in runs.items():
            start = time.perf_counter()
            run(xs, ws)
            if repetition:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--megabytes", type=float, default=200.0, help="weight bytes a pass reads (default 200 MB)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "matvec_bandwidth.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    stream = torch.randn(int(args.megabytes * 1e6 / 4), generator=generator)
    seconds = _passes({"sum": lambda xs, ws: stream.sum()}, args, None, None)["sum"]
    rows_out = [{"case": "streaming sum, float32", "gb_per_s": stream.numel() * 4 / seconds / 1e9}]
    print(f"streaming sum of {args.megabytes:.0f} MB: {rows_out[0]['gb_per_s']:.1f} GB/s")
    del stream
    compiled = torch.compile(_reduction, dynamic=False)
    for dtype in args.dtypes.split(","):
        for shape in SHAPES:
            for rows in (int(b) for b in args.rows.split(",")):
                torch._dynamo.reset()
                width = torch.empty((), dtype=getattr(torch, dtype)).element_size()
                count = max(1, round(args.megabytes * 1e6 / (shape[0] * shape[1] * width)))
                ws = [torch.randn(*shape, generator=generator).to(getattr(torch, dtype)) for _ in range(count)]
                xs = [torch.randn(rows, shape[1], generator=generator).to(ws[0].dtype) for _ in range(count)]
                medians = _passes({"blas": _blas, "reduction": compiled}, args, xs, ws)
                nbytes = count * shape[0] * shape[1] * width
                row = {"dtype": dtype, "shape": list(shape), "rows": rows, "weights": count,
                       **{f"{name}_gb_per_s": nbytes / value / 1e9 for name, value in medians.items()}}
                rows_out.append(row)
                print(f"{dtype:<9} {shape} b={rows}: blas {row['blas_gb_per_s']:5.1f} GB/s, "
                      f"reduction {row['reduction_gb_per_s']:5.1f} GB/s ({count} weights)")
    write_json({"settings": vars(args) | {"json": str(args.json)}, "machine": machine_info(), "rows": rows_out},
               args.json)


if __name__ == "__main__":
    main()
