"""Long-context decode: original vs hybrid vs latentllm (latent cache) at 512 / 2048 / 4096 / 8192 tokens,
batch 1 and 4: tokens/s, step time, cache bytes and peak memory, interleaved. See docs/bench.md.

    python benchmarks/long_context.py                          # eager, each model's own (dynamic) cache
    python benchmarks/long_context.py --batch-sizes 4 --json benchmarks/results/long_context_b4.json

The cache is grown to the context without a long prefill (eval/decode_loop.fill_cache: a real prefill
of --fill-prefill tokens, then the entries repeated up to n; a hybrid state is shifted to n tokens
seen): the decode cost depends on the cache's shapes, not its contents. Contexts beyond the model's
max_position_embeddings are allowed (the limit is raised; RoPE is computed per position), since speed,
not quality, is measured. Models are specs of benchmarks/speed_models.py; ``hybrid`` is the untrained
swap (same shapes and cost as a trained one).
"""

from __future__ import annotations

import argparse

from speed_models import ROOT, add_decode_bench_flags, build_models, int_list, report_decode_bench, set_threads

from retrofitter.eval.bench_decode import bench_decode

DEFAULT_MODELS = ["smollm2-135m", "hybrid", "latentllm:0.3"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_decode_bench_flags(parser, DEFAULT_MODELS, ROOT / "benchmarks" / "results" / "long_context.json")
    parser.add_argument("--batch-sizes", type=int_list, default=(1, 4))
    parser.add_argument("--contexts", type=int_list, default=(512, 2048, 4096, 8192))
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--fill-prefill", type=int, default=128, help="real prefill tokens before the cache is grown")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    models = build_models(args.models, args.base, args.calib_samples)
    for _, model, _ in models:  # speed only: positions past the trained range are allowed
        model.config.max_position_embeddings = max(model.config.max_position_embeddings,
                                                   max(args.contexts) + args.decode_tokens + 1)
    bench = bench_decode([(label, model) for label, model, _ in models], modes=("eager",), cache="dynamic",
                         batch_sizes=args.batch_sizes, contexts=args.contexts, prefill_len=0,
                         decode_tokens=args.decode_tokens, fill_prefill=args.fill_prefill, repeats=args.repeats,
                         warmup=args.warmup, floor=not args.no_floor, progress=True)
    report_decode_bench(bench, args.models, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
