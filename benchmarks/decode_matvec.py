"""Compiled decode steps with their linear maps as BLAS calls against fused reductions (``ops/matvec.py``), for
the original and a converted model, interleaved (``eval.bench_decode``: static caches, medians of the step time).

Each model runs under two labels, ``<label> blas`` and ``<label> reduction`` (``bench_decode(matvec=)`` per label),
so every ratio below comes from one run. Also prints what ``choose_matvec`` (``bench --compile --matvec auto``)
measures on each model's own weights.

    python benchmarks/decode_matvec.py smollm2-135m runs/mla-0.25 --contexts 512,2048,4096,8192 --threads 2

Writes --json (default benchmarks/results/decode_matvec.json) and prints the step times and ratios.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from retrofitter.api import load_model, write_json
from retrofitter.eval.bench_decode import bench_decode
from retrofitter.eval.decode_loop import choose_matvec

ROOT = Path(__file__).resolve().parents[1]
FORMS = ("blas", "reduction")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("original")
    parser.add_argument("models", nargs="+", help="converted models to compare with the original")
    parser.add_argument("--contexts", default="512,2048,4096,8192")
    parser.add_argument("--batch-sizes", default="1")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "decode_matvec.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = {"original": args.original, **{f"model{i + 1}": name for i, name in enumerate(args.models)}}
    loaded = {label: load_model(name, dtype=args.dtype)[0].eval() for label, name in names.items()}
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    chosen = {label: {b: choose_matvec(model, rows=b) for b in batch_sizes} for label, model in loaded.items()}
    for label, by_batch in chosen.items():
        for b, choice in by_batch.items():
            print(f"choose_matvec {label} ({names[label]}) b={b}: {choice}")
    models = [(f"{label} {form}", model) for label, model in loaded.items() for form in FORMS]
    result = bench_decode(models, modes=("compiled",), batch_sizes=batch_sizes,
                          contexts=[int(n) for n in args.contexts.split(",")], prefill_len=0,
                          decode_tokens=args.decode_tokens, repeats=args.repeats, floor=False,
                          matvec={label: label.rsplit(" ", 1)[1] for label, _ in models}, progress=True)
    write_json({"settings": vars(args) | {"json": str(args.json), "names": names}, "choose_matvec": chosen,
                "bench_decode": result}, args.json)
    for b, entries in result["results"]["compiled"].items():
        for label, entry in entries.items():
            model, form = label.rsplit(" ", 1)
            other = entries[f"{model} {'blas' if form == 'reduction' else 'reduction'}"]["decode"]
            same_form = entries[f"original {form}"]["decode"]
            print(f"b={b} {label:<20} " + "  ".join(
                f"@{n} {d['step_s']['median'] * 1e3:7.2f} ms (x{d['step_s']['median'] / same_form[n]['step_s']['median']:.3f} "
                f"the original {form}, x{d['step_s']['median'] / other[n]['step_s']['median']:.3f} the other form)"
                for n, d in entry["decode"].items()))


if __name__ == "__main__":
    main()
