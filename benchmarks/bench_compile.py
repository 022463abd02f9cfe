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

from speed_models import ROOT, add_decode_bench_flags, build_models, int_list, report_decode_bench, set_threads

from retrofitter.eval.bench_decode import MODES, bench_decode

DEFAULT_MODELS = ["smollm2-135m", "asvd-rootcov:0.3", "latentllm:0.3"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_decode_bench_flags(parser, DEFAULT_MODELS, ROOT / "benchmarks" / "results" / "bench_compile.json")
    parser.add_argument("--batch-sizes", type=int_list, default=(1,))
    parser.add_argument("--contexts", type=int_list, default=(512,))
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args(argv)
    set_threads(args.threads)
    models = build_models(args.models, args.base, args.calib_samples)
    bench = bench_decode([(label, model) for label, model, _ in models], modes=args.modes.split(","),
                         batch_sizes=args.batch_sizes, contexts=args.contexts, prefill_len=args.prefill_len,
                         decode_tokens=args.decode_tokens, repeats=args.repeats, warmup=args.warmup,
                         floor=not args.no_floor, progress=True)
    report_decode_bench(bench, args.models, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
