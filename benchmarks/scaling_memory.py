"""Peak memory of compression in memory vs out of core (``compress --out-of-core``), and whether they agree.

Each mode runs in its own subprocess (``--worker``) so that its peak resident set size is its own:
``ru_maxrss`` of the worker (whole process), the floor (RSS after loading everything a run loads besides
the weights: interpreter, torch, transformers, the model class on the meta device, the tokenizer, the
corpus text; ~360 MiB here) and the peak sampled during the compression alone. The two output
directories are then compared tensor by tensor (max |a − b| over every factor, bias and copied weight).

    python benchmarks/scaling_memory.py --model smollm2-135m --calib-samples 32 --seq-len 512 --batch-size 4 \
        --out benchmarks/results/scaling_memory   # SmolLM2-135M: ~2 × 10 min on one free core

``--model`` takes an alias or a local HF directory (safetensors). The criterion of docs/scaling.md:
out-of-core peak RSS above the import floor < 0.5 × the fp32 model size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def worker(args) -> None:
    """One compression in this process; prints one JSON line of its memory and time."""
    import torch

    torch.set_num_threads(args.threads)
    from retrofitter.config import CompressConfig
    from retrofitter.jobs import compress_job

    floor = warm_up(args.model, args.calib)  # what any run holds before its first model byte
    config = CompressConfig(ratio=args.ratio, method=args.method, allocation=args.allocation, batch_size=args.batch_size)
    start = time.perf_counter()
    record = compress_job(args.model, Path(args.out), config, calib=args.calib, calib_samples=args.calib_samples,
                          seq_len=args.seq_len, overwrite=True, progress=False, out_of_core=args.mode == "out-of-core")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"mode": args.mode, "seconds": time.perf_counter() - start, "floor_mb": floor,
                      "peak_rss_mb": peak, "peak_above_floor_mb": peak - floor,
                      "compress_sampled_peak_mb": record.get("compress_peak_rss_mb"),
                      "params_total": record["params"]["total"]}))


def warm_up(model: str, calib: str) -> float:
    """Load what every run loads besides the weights: the interpreter, torch, transformers, the model's class
    (built on the meta device: no weight), its tokenizer, the corpus text, LAPACK. Returns the RSS then (MiB)."""
    import torch

    from retrofitter.api import load_tokenizer
    from retrofitter.data.corpora import load_text
    from retrofitter.data.models import resolve_model_source
    from retrofitter.pipelines.offload import empty_model

    load_tokenizer(model)
    empty_model(resolve_model_source(model), torch.float32)
    load_text(calib)
    probe = torch.randn(64, 64, dtype=torch.float64)
    torch.linalg.eigh(probe @ probe.T)
    torch.linalg.svd(probe)
    return _rss_mb()


def _weights(directory: Path) -> dict:
    from safetensors import safe_open

    files = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            files.update({key: file for key in handle.keys()})
    return files


def max_abs_diff(left: Path, right: Path) -> dict:
    """Max |a − b| over the tensors of two saved directories (read one at a time), and the keys only one of them has."""
    from safetensors import safe_open

    a, b = _weights(left), _weights(right)
    worst, by_kind = 0.0, {}
    for key in sorted(set(a) & set(b)):
        with safe_open(str(a[key]), framework="pt") as fa, safe_open(str(b[key]), framework="pt") as fb:
            x, y = fa.get_tensor(key), fb.get_tensor(key)
        diff = float((x.double() - y.double()).abs().max()) if x.shape == y.shape else float("inf")
        kind = key.rsplit(".", 1)[-1]
        by_kind[kind] = max(by_kind.get(kind, 0.0), diff)
        worst = max(worst, diff)
    return {"max_abs_diff": worst, "max_abs_diff_by_tensor": by_kind, "only_in_first": sorted(set(a) - set(b)),
            "only_in_second": sorted(set(b) - set(a))}


def fp32_size_mb(model: str) -> float:
    """Σ numel over the source's safetensors tensors × 4 bytes (headers only, no weight is read)."""
    from safetensors import safe_open

    from retrofitter.data.models import resolve_model_source

    total = 0
    for file in Path(resolve_model_source(model)).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                total += math.prod(handle.get_slice(key).get_shape())
    return total * 4 / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="asvd-rootcov")
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--allocation", default="uniform", choices=("uniform", "global"),
                        help="global: the default of compress, in memory only (out of core refuses it)")
    parser.add_argument("--calib", default="wiki-calib")
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4, help="calibration batch (per-batch activations)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/scaling_memory"))
    parser.add_argument("--modes", default="in-memory,out-of-core",
                        help="modes to run; a mode not run keeps its record and output directory from an earlier "
                             "run in --out (marked reused)")
    parser.add_argument("--worker", choices=("in-memory", "out-of-core"), dest="mode")
    args = parser.parse_args()
    if args.mode:
        worker(args)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    earlier = args.out / "scaling_memory.json"
    runs = json.loads(earlier.read_text())["runs"] if earlier.exists() else {}
    for mode in runs:
        runs[mode]["reused"] = True
    for mode in args.modes.split(","):
        command = [sys.executable, __file__, "--worker", mode, "--model", args.model, "--method", args.method,
                   "--ratio", str(args.ratio), "--allocation", args.allocation, "--calib", args.calib, "--calib-samples", str(args.calib_samples),
                   "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--threads", str(args.threads),
                   "--out", str(args.out / mode)]
        done = subprocess.run(command, check=True, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        runs[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        print(json.dumps(runs[mode]))
    fp32 = fp32_size_mb(args.model)
    result = {"model": args.model, "method": args.method, "ratio": args.ratio, "allocation": args.allocation,
              "calib_samples": args.calib_samples, "seq_len": args.seq_len, "batch_size": args.batch_size,
              "threads": args.threads, "fp32_model_mb": fp32, "runs": runs}
    for mode in runs:
        result[f"{mode.replace('-', '_')}_peak_above_floor_over_fp32"] = runs[mode]["peak_above_floor_mb"] / fp32
    if {"in-memory", "out-of-core"} <= set(runs):
        result.update(max_abs_diff(args.out / "in-memory", args.out / "out-of-core"))
    (args.out / "scaling_memory.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
