"""Prefill eager and ``torch.compile``d, interleaved, and where one compiled prefill spends its time (per op).

Each model runs one forward of random ids ``[1, --tokens]`` without a cache and with the last position's
logits only (what generation needs; as ``retrofitter bench --compile``), eager and compiled (inductor,
static shapes), the models and modes interleaved over ``--repeats`` timed repetitions after two warm-ups.
A ratio is the median over repetitions of each repetition's time over the first model's in that repetition
(with its quartiles), so drift of the machine between repetitions cancels.
Then ``torch.profiler`` records one compiled forward per model: self CPU time per op (matrix products,
the attention kernel, the compiled graph's own fused kernels, ...), which says where a gap comes from.
Beside the times, the bound from arithmetic: each model's multiply-adds per token of a last-logit prefill
(``eval.accounting``: every projection, K_up / V_up where not folded, attention at the causal average of
``--tokens``; the LM head once per prefill, left out), over the first model's.

    python benchmarks/profile_prefill_compiled.py smollm2-135m runs/mla-0.25 --tokens 512 --threads 2

``--attn-implementations`` gives each model its HF attention kernel (comma-separated, one per model; the same
model may be listed twice with two kernels). An MLA model under ``flex_attention`` (or eager) reads the
value c [r] instead of the key [c, k_pe] (modules/mla_attention.py), which SDPA's fused CPU kernel cannot.

Writes --json (default benchmarks/results/profile_prefill_compiled.json) and prints the table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from retrofitter.api import load_model, write_json
from retrofitter.eval.accounting import account
from retrofitter.eval.bench import machine_info, unique_labels

ROOT = Path(__file__).resolve().parents[1]


def prefill_fn(model):
    return lambda ids: model(input_ids=ids, use_cache=False, logits_to_keep=1).logits


def prefill_macs_per_token(model, tokens: int) -> int:
    """Multiply-adds per token of a last-logit prefill of ``tokens``: projections and attention, no LM head."""
    counts = account(model, context=tokens)
    head = model.get_output_embeddings()
    return counts.macs_per_token - (head.weight.numel() if head is not None else 0) + counts.attention_macs_per_token


def op_profile(fn, ids, top: int) -> dict[str, float]:
    """Self CPU milliseconds of the ``top`` most expensive ops of one call."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(ids)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {e.key: e.self_cpu_time_total / 1e3 for e in events}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="the first is the baseline of the ratios")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--top", type=int, default=6, help="ops listed per profile")
    parser.add_argument("--attn-implementations", default=None,
                        help="comma-separated HF attention implementations, one per model (default: each model's own)")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "profile_prefill_compiled.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = args.attn_implementations.split(",") if args.attn_implementations else [None] * len(args.models)
    if len(kernels) != len(args.models):
        parser.error(f"--attn-implementations names {len(kernels)} kernels for {len(args.models)} models")
    labels = unique_labels([path if kernel is None else f"{path} [{kernel}]"
                            for path, kernel in zip(args.models, kernels)])
    models = {label: load_model(path)[0].eval() for label, path in zip(labels, args.models)}
    for model, kernel in zip(models.values(), kernels):
        if kernel is not None:
            model.set_attn_implementation(kernel)
    vocab = min(m.get_input_embeddings().num_embeddings for m in models.values())
    ids = torch.randint(3, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    fns = {}
    for label, model in models.items():
        fns[label, "eager"] = prefill_fn(model)
        fns[label, "compiled"] = torch.compile(prefill_fn(model), dynamic=False)
    seconds = {key: [] for key in fns}
    # every model's compiled forward shares the code object of prefill_fn's lambda: one cache entry per model and
    # kernel, more than dynamo's default limit of 8 recompiles with several models (as bench_decode)
    with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=1024, accumulated_recompile_limit=8192,
                                                            fail_on_recompile_limit_hit=True):
        for _ in range(2):  # warm-up (and compile), in rounds: a later model's first call may change a global a
            for fn in fns.values():  # compiled graph guards on (HF's flex wrapper), which recompiles it once
                fn(ids)
        for _ in range(args.repeats):
            for key, fn in fns.items():
                start = time.perf_counter()
                fn(ids)
                seconds[key].append(time.perf_counter() - start)
        ops = {label: op_profile(fns[label, "compiled"], ids, args.top) for label in models}
    base = labels[0]
    macs = {label: prefill_macs_per_token(model, args.tokens) for label, model in models.items()}
    # each repetition times every model once, so the ratio within a repetition is free of the machine's drift
    paired = {key: sorted(t / b for t, b in zip(seconds[key], seconds[base, key[1]])) for key in fns}
    median = {key: statistics.median(times) for key, times in seconds.items()}
    rows = {label: {mode: {"median_ms": median[label, mode] * 1e3, "min_ms": min(seconds[label, mode]) * 1e3,
                           "ratio_median": median[label, mode] / median[base, mode],
                           "paired_ratio_median": statistics.median(paired[label, mode]),
                           "paired_ratio_quartiles": [paired[label, mode][len(paired[label, mode]) // 4],
                                                      paired[label, mode][(3 * len(paired[label, mode])) // 4]],
                           "seconds": seconds[label, mode]}
                    for mode in ("eager", "compiled")} | {"macs_per_token": macs[label],
                                                          "macs_ratio": macs[label] / macs[base]}
            for label in labels}
    write_json({"settings": vars(args) | {"json": str(args.json)}, "machine": machine_info(), "prefill": rows,
                "compiled_ops_self_ms": ops}, args.json)
    for label in labels:
        timed = {mode: rows[label][mode] for mode in ("eager", "compiled")}
        print(f"{label:<28} " + "  ".join(
            f"{mode} {r['median_ms']:7.1f} ms (paired {r['paired_ratio_median']:.3f}x "
            f"[{r['paired_ratio_quartiles'][0]:.3f}, {r['paired_ratio_quartiles'][1]:.3f}])"
            for mode, r in timed.items())
              + f"  arithmetic {macs[label] / 1e6:.2f} M MACs/token ({rows[label]['macs_ratio']:.3f}x)")
    for label in labels:
        print(f"compiled ops, {label}: " + ", ".join(f"{k[:48]} {v:.1f} ms" for k, v in ops[label].items()))


if __name__ == "__main__":
    main()
