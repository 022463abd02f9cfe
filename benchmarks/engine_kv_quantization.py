"""The KV cache at equal bytes, in llama.cpp: MLA conversions against the original with a quantized cache.

Users who want a smaller KV cache can also just quantize it: llama.cpp's ``-ctk/-ctv q8_0`` or ``q4_0``. This
puts both on one axis. Each model (the original and its MLA conversions, ``retrofitter mla`` [+ ``heal``]) is
exported to an f32 GGUF and scored by ``llama-perplexity`` with its cache in each of ``--cache-types``, flash
attention on in every row (a quantized V cache needs it), so only the cache changes. Per row:

- bytes per token, all layers (``eval.llama_cpp.cache_bytes_per_token``; the run stops if llama.cpp's own
  allocation, logged to 0.01 MiB, disagrees), and its ratio to the original's f16 cache;
- perplexity on each corpus (windows of ``--n-ctx``, the second half of each scored), and the paired ratio to the
  original with an f16 cache over the same windows (``eval.perplexity.paired_ratio``: 95 % interval over windows);
- with ``--depths``: decode tokens/s (``llama-bench``, ``--n-gen`` tokens after that much context), and with
  ``--prefill``: prompt tokens/s of a prompt of that length; in ``--repeats`` rounds that each time every row
  once, so the rows of a round see the same machine state; the time ratio to the original with an f16 cache is
  the median over rounds.

    python benchmarks/engine_kv_quantization.py --mla runs/mla-0.25-healed --mla runs/mla-0.5-healed --depths 4096 \
        --prefill 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import retrofitter
from retrofitter.data.corpora import load_text
from retrofitter.engines.llama_cpp import llama_cpp_dir
from retrofitter.eval.engine_table import ENGINE_KV_KIND, engine_kv_table
from retrofitter.eval.llama_cpp import cache_bytes_per_token, gguf_metadata, llama_bench, llama_perplexity
from retrofitter.eval.perplexity import paired_ratio
from retrofitter.pipelines.export import export_gguf

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ("original", "f16")


def _export(args) -> dict:
    """{name: gguf path}: the original and each --mla directory (named by its directory)."""
    models = {"original": args.model, **{Path(path).name: path for path in args.mla}}
    paths = {}
    for name, source in models.items():
        paths[name] = args.out / f"{name}.gguf"
        if paths[name].exists():
            continue
        model, tokenizer = retrofitter.load(source)
        export_gguf(model.eval(), paths[name], tokenizer)
        del model
    return paths


def _score(args, gguf: dict, texts: dict) -> dict:
    rows = {}
    for name, path in gguf.items():
        meta = gguf_metadata(path)
        for cache_type in args.cache_types:
            row = rows[f"{name} {cache_type}"] = {"model": name, "cache_type": cache_type,
                                                   "bytes_per_token": cache_bytes_per_token(meta, cache_type)}
            for corpus, text_file in texts.items():
                result = llama_perplexity(path, text_file, args.n_ctx, chunks=args.chunks or None,
                                          threads=args.threads, cache_type=cache_type, flash_attn="on")
                kv = result["kv_cache"]
                logged, counted = kv["mib"] * 2**20, kv["cells"] * row["bytes_per_token"]
                if abs(logged - counted) > 0.00501 * 2**20:
                    raise SystemExit(f"{name} {cache_type}: llama.cpp allocated {kv['mib']} MiB for {kv['cells']} "
                                     f"cells, {counted / 2**20:.3f} MiB counted")
                row.setdefault("corpora", {})[corpus] = result
                row["kv_cache"] = kv
                print(f"{name} {cache_type} {corpus}: ppl {result['ppl']:.4f} over {result['chunks']} windows, "
                      f"{row['bytes_per_token']} B/token ({result['seconds']:.0f} s)", flush=True)
    scored = args.n_ctx - 1 - args.n_ctx // 2  # tokens llama-perplexity scores per window
    reference = rows[" ".join(REFERENCE)]
    for row in rows.values():
        row["bytes_ratio"] = row["bytes_per_token"] / reference["bytes_per_token"]
        for corpus, result in row["corpora"].items():
            base = torch.tensor(reference["corpora"][corpus]["chunk_nll"], dtype=torch.float64) * scored
            ours = torch.tensor(result["chunk_nll"], dtype=torch.float64) * scored
            result["paired"] = vars(paired_ratio(base, ours, scored + 1)) if row is not reference else None
    return rows


def _speed(args, gguf: dict, rows: dict) -> None:
    """Decode after each of --depths and prefill of each of --prefill tokens, in --repeats rounds: each round
    times every row once (llama-bench -r 1), so drift of the machine's speed over the minutes a setting takes
    reaches every row of a round alike. Per row: the median tokens/s over rounds and time_ratio, the median
    over rounds of the reference row's tokens/s over this row's (time per token × the reference's)."""
    settings = [("decode", depth, {"n_gen": args.n_gen}) for depth in args.depths]
    settings += [("prefill", n, {"n_gen": 0, "n_prompt": n}) for n in args.prefill]
    reference = " ".join(REFERENCE)
    for kind, tokens, bench in settings:
        rounds = []
        for round_index in range(args.repeats):
            measured = {}
            for key, row in rows.items():
                measured[key], = llama_bench(gguf[row["model"]], [tokens if kind == "decode" else 0], **bench,
                                             repetitions=1, threads=args.threads, cache_type=row["cache_type"],
                                             flash_attn="on")
                print(f"{kind} {tokens} round {round_index + 1} {key}: {measured[key]['tokens_per_s']:.2f} tok/s",
                      flush=True)
            rounds.append(measured)
        for key, row in rows.items():
            speeds = [r[key]["tokens_per_s"] for r in rounds]
            ratios = [r[reference]["tokens_per_s"] / r[key]["tokens_per_s"] for r in rounds]
            row.setdefault(kind, {})[str(tokens)] = {
                "tokens_per_s": statistics.median(speeds), "rounds_tokens_per_s": speeds,
                "time_ratio": statistics.median(ratios), "rounds_time_ratio": ratios,
                "kv_cache": rounds[-1][key]["kv_cache"], "threads": rounds[-1][key]["threads"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="the original model")
    parser.add_argument("--mla", action="append", default=[], help="an MLA conversion's directory (repeatable)")
    parser.add_argument("--cache-types", default="f16,q8_0,q4_0", help="llama.cpp cache types, f16 first")
    parser.add_argument("--corpora", default="wiki-eval,/usr/share/common-licenses/GPL-3")
    parser.add_argument("--n-ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=64, help="windows per corpus (0: the whole text)")
    parser.add_argument("--depths", default="", help="decode contexts for llama-bench, e.g. 4096,8192 (none: skip)")
    parser.add_argument("--prefill", default="", help="prompt lengths whose prefill llama-bench times, e.g. 512,2048")
    parser.add_argument("--n-gen", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the rows per speed setting")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/engine-kv"), help="GGUFs and corpus files")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "engine_kv_quantization.json")
    args = parser.parse_args()
    args.cache_types = [t for t in args.cache_types.split(",") if t]
    args.depths = [int(d) for d in args.depths.split(",") if d]
    args.prefill = [int(n) for n in args.prefill.split(",") if n]
    if args.cache_types[0] != REFERENCE[1]:
        parser.error(f"--cache-types must start with {REFERENCE[1]}, the reference row's cache")
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    texts = {}
    for corpus in args.corpora.split(","):
        texts[corpus] = args.out / f"{Path(corpus).name}.txt"
        texts[corpus].write_text(load_text(corpus))
    gguf = _export(args)
    rows = _score(args, gguf, texts)
    _speed(args, gguf, rows)
    record = {"kind": ENGINE_KV_KIND, "speed_scheme": "rounds",
              "llama_cpp": json.loads((llama_cpp_dir() / "build.json").read_text()),
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "files": {k: str(v) for k, v in gguf.items()}, "rows": rows,
              "seconds": round(time.perf_counter() - start, 1)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    print("\n".join(engine_kv_table(record)))


if __name__ == "__main__":
    main()
