"""Data-parallel compression: 2 processes × 1 thread (``torchrun``, gloo) vs 1 process × 2 threads.

Both runs are the public command line (``python -m retrofitter compress ...``), timed from outside
(wall time including start-up and the load), with the same calibration and settings; then the two
output directories are compared tensor by tensor (max |a − b| of every factor, by tensor kind).

    python benchmarks/scaling_parallel.py --model smollm2-135m --calib-samples 64 --seq-len 512 \
        --out runs/scaling_parallel          # SmolLM2-135M, asvd-rootcov uniform: ~2 × 3 min on 2 cores

``--out-of-core`` runs both in out-of-core mode; ``--processes`` / ``--threads`` change the split.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cli_runner import run_retrofitter
from scaling_memory import max_abs_diff  # benchmarks/ is the script's directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="asvd-rootcov")
    parser.add_argument("--allocation", default="uniform")
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--calib", default="wiki-calib")
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8, help="calibration batch; >= processes batches needed")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--out-of-core", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("runs/scaling_parallel"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    flags = ["compress", args.model, "--method", args.method, "--allocation", args.allocation, "--ratio",
             str(args.ratio), "--calib", args.calib, "--calib-samples", str(args.calib_samples), "--seq-len",
             str(args.seq_len), "--batch-size", str(args.batch_size), "--no-eval", "--quiet", "--overwrite"] + (["--out-of-core"] if args.out_of_core else [])
    n = args.processes
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
    seconds = {f"1x{n}_threads": run_retrofitter([*flags, "--out", str(args.out / "single")], threads=n),
               f"{n}x1_processes": run_retrofitter([*flags, "--out", str(args.out / "parallel")], threads=1,
                                                   launcher=torchrun)}
    result = {"model": args.model, "method": args.method, "allocation": args.allocation, "ratio": args.ratio,
              "calib_samples": args.calib_samples, "seq_len": args.seq_len, "out_of_core": args.out_of_core,
              "wall_seconds": seconds, "speedup": seconds[f"1x{n}_threads"] / seconds[f"{n}x1_processes"],
              **max_abs_diff(args.out / "single", args.out / "parallel")}
    (args.out / "scaling_parallel.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
