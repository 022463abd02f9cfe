"""Where one ``torch.compile``d decode step spends its time, and how many compiled graphs it runs.

Each model's cache (static, as ``retrofitter bench --compile``) is filled to ``--context`` tokens
(``eval.decode_loop.fill_cache``: a 512-token prefill, then its entries repeated), the step is compiled
(inductor, static shapes) and run ``--warmup`` times, then ``torch.profiler`` records ``--steps`` steps. Per step:
the profiled self CPU time, the compiled regions entered and dynamo's guard checks ("cache lookups"; one per step
when the step is one graph, more for every graph break), and the ops that take the most self time.

    python benchmarks/profile_decode_compiled.py smollm2-135m runs/mla-0.25 --context 4096 --threads 2 [--matvec reduction]

Writes --json (default benchmarks/results/profile_decode_compiled.json) and prints one line per model.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from retrofitter.api import load_model, write_json
from retrofitter.eval.bench import machine_info, unique_labels
from retrofitter.eval.decode_loop import compile_step, fill_cache, make_cache

ROOT = Path(__file__).resolve().parents[1]
REGION, LOOKUP = "Torch-Compiled Region", "TorchDynamo Cache Lookup"


@torch.inference_mode()
def profile_steps(model, context: int, warmup: int, steps: int, top: int, matvec: str = "blas") -> dict:
    """The per-step profile of a compiled decode step at ``context`` cached tokens (module docstring); ``matvec``
    "reduction" traces its linear maps as fused reductions (``compile_step(reduction_rows=1)``)."""
    ids = torch.randint(0, model.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
    cache = make_cache(model, "static", max_cache_len=context + warmup + steps + 1)
    tokens = fill_cache(model, cache, ids[:, :min(512, context)], context).argmax(-1)   # [1, 1]
    step = compile_step(model, reduction_rows=1 if matvec == "reduction" else 0)
    position = context
    for _ in range(warmup):
        step(tokens, torch.full((1, 1), position), cache)
        position += 1
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step(tokens, torch.full((1, 1), position), cache)
            position += 1
    events = prof.key_averages()
    regions = sum(e.count for e in events if e.key.startswith(REGION))
    lookups = sum(e.count for e in events if e.key == LOOKUP)
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {"self_ms_per_step": sum(e.self_cpu_time_total for e in events) / 1e3 / steps,
            "compiled_regions_per_step": regions / steps, "cache_lookups_per_step": lookups / steps,
            "top_ops_self_ms_per_step": {e.key: e.self_cpu_time_total / 1e3 / steps for e in ranked}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--matvec", choices=("blas", "reduction"), default="blas",
                        help="how the step runs its linear maps (ops/matvec.py)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "profile_decode_compiled.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = {}
    for label, path in zip(unique_labels(args.models), args.models):
        torch._dynamo.reset()
        rows[label] = profile_steps(load_model(path)[0].eval(), args.context, args.warmup, args.steps, args.top,
                                     args.matvec)
        row = rows[label]
        print(f"{label:<28} {row['self_ms_per_step']:6.1f} ms a step, {row['compiled_regions_per_step']:.0f} compiled "
              f"regions, {row['cache_lookups_per_step']:.0f} cache lookups; " + ", ".join(
                  f"{k[:40]} {v:.1f} ms" for k, v in list(row["top_ops_self_ms_per_step"].items())[:4]))
    write_json({"settings": vars(args) | {"json": str(args.json)}, "machine": machine_info(), "decode": rows},
               args.json)


if __name__ == "__main__":
    main()
