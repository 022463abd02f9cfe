"""Framework overhead removed: prefill and decode, eager and torch.compile'd, on static caches, plus the
overhead floor (the first model with its projections and LM head skipped). See docs/bench.md.

    python benchmarks/bench_compile.py                                  # smollm2-135m, asvd-rootcov 0.3, latentllm 0.3
    python benchmarks/bench_compile.py --batch-sizes 8 --json benchmarks/results/bench_compile_b8.json
    python benchmarks/bench_compile.py smollm2-135m runs/bench/my-model --threads 2

Models are specs of benchmarks/speed_models.py (names, directories, METHOD:RATIO compressed here on
--calib-samples blocks and saved under runs/bench/, hybrid[:WINDOW]). Writes a ``"kind": "bench_decode"``
JSON and prints the table (ratios vs the first model, and net of the overhead floor).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from speed_models import ROOT, build_models, set_threads

from retrofitter.api import write_json
from retrofitter.eval.bench_decode import MODES, bench_decode
from retrofitter.eval.bench_table import format_decode_table

DEFAULT_MODELS = ["smollm2-135m", "asvd-rootcov:0.3", "latentllm:0.3"]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=DEFAULT_MODELS, help=f"model specs (default {DEFAULT_MODELS})")
    parser.add_argument("--base", default="smollm2-135m", help="model that METHOD:RATIO and hybrid specs start from")
    parser.add_argument("--calib-samples", type=int, default=8)
    parser.add_argument("--batch-sizes", type=_ints, default=(1,))
    parser.add_argument("--contexts", type=_ints, default=(512,))
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--no-floor", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "bench_compile.json")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    models = build_models(args.models, args.base, args.calib_samples)
    bench = bench_decode([(label, model) for label, model, _ in models], modes=args.modes.split(","),
                         batch_sizes=args.batch_sizes, contexts=args.contexts, prefill_len=args.prefill_len,
                         decode_tokens=args.decode_tokens, repeats=args.repeats, warmup=args.warmup,
                         floor=not args.no_floor, progress=True)
    bench["settings"]["model_specs"] = args.models
    print(format_decode_table(bench))
    write_json(bench, args.json)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
