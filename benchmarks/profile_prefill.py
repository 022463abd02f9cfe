"""Where prefill time goes: per-part wall time of one forward pass, for several models side by side.

Forward hooks time every projection (q/k/v/o, gate/up/down or fc1/fc2, lm_head) and every attention
and MLP block; what an attention block spends outside its projections is "attention core" (scores,
softmax, RoPE, cache writes), what an MLP spends outside its projections is "mlp activation", and the
remainder of the forward is "other" (embeddings, norms, residual adds, masks). Repetitions are
interleaved across models (A, B, A, B) and the median per part is reported with its ratio to the
first model. Hooks cost a few microseconds each, far below the millisecond-scale parts they time on
the real model (on tiny models they dominate).

    python benchmarks/profile_prefill.py smollm2-135m runs/bench/asvd-rootcov-0.3 --tokens 512

Writes benchmarks/results/profile_prefill.json and prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from retrofitter.adapters import adapter_for
from retrofitter.api import load_model, write_json
from retrofitter.eval.bench import machine_info, unique_labels

ROOT = Path(__file__).resolve().parents[1]


def part_timers(model: nn.Module) -> tuple[dict, list]:
    """Register timing hooks; returns (seconds by module path, handles). Paths: projections, blocks, lm_head."""
    adapter = adapter_for(model)
    seconds: dict[str, float] = defaultdict(float)
    starts: dict[str, float] = {}
    handles = []

    def watch(path: str, module: nn.Module) -> None:
        def before(_module, _args):
            starts[path] = time.perf_counter()

        def after(_module, _args, _output):
            seconds[path] += time.perf_counter() - starts.pop(path)

        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_forward_hook(after))

    for index, layer in enumerate(adapter.decoder_layers(model)):
        watch(f"{index}.attention", adapter.attention(layer))
        watch(f"{index}.mlp", adapter.mlp(layer))
        for name in adapter.linear_names:
            watch(f"{index}.{name}", adapter.get_linear(layer, name))
    head = model.get_output_embeddings()
    if head is not None:
        watch("lm_head", head)
    return seconds, handles


def breakdown(model: nn.Module, seconds: dict, total: float) -> dict:
    """Group the per-module times into parts (projection names, attention core, mlp activation, lm_head, other)."""
    adapter = adapter_for(model)
    attention_names = [n for n in adapter.linear_names if n in ("q", "k", "v", "o")]
    parts: dict[str, float] = defaultdict(float)
    for index in range(len(adapter.decoder_layers(model))):
        for name in adapter.linear_names:
            parts[f"proj {name}"] += seconds.get(f"{index}.{name}", 0.0)
        attention_projections = sum(seconds.get(f"{index}.{n}", 0.0) for n in attention_names)
        mlp_projections = sum(seconds.get(f"{index}.{n}", 0.0) for n in adapter.linear_names
                              if n not in attention_names)
        parts["attention core"] += seconds.get(f"{index}.attention", 0.0) - attention_projections
        parts["mlp activation"] += seconds.get(f"{index}.mlp", 0.0) - mlp_projections
    parts["lm_head"] = seconds.get("lm_head", 0.0)
    parts["other"] = total - sum(parts.values())
    parts["total"] = total
    return dict(parts)


@torch.inference_mode()
def profile_once(model: nn.Module, ids: torch.Tensor, logits_to_keep: int) -> dict:
    seconds, handles = part_timers(model)
    try:
        start = time.perf_counter()
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=logits_to_keep)
        total = time.perf_counter() - start
    finally:
        for handle in handles:
            handle.remove()
    return breakdown(model, seconds, total)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="models load_model accepts; the first is the reference")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--logits-to-keep", type=int, default=0,
                        help="0 = logits for every position (a scoring forward); 1 = last only (generate's prefill)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "profile_prefill.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    labels = unique_labels(args.models)
    loaded = [(label, load_model(name)[0]) for label, name in zip(labels, args.models)]
    vocab = loaded[0][1].config.vocab_size
    ids = torch.randint(0, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    samples: dict[str, list[dict]] = {label: [] for label, _ in loaded}
    for repetition in range(args.warmup + args.repeats):
        for label, model in loaded:
            result = profile_once(model, ids, args.logits_to_keep)
            if repetition >= args.warmup:
                samples[label].append(result)
    medians = {label: {part: statistics.median(s[part] for s in runs) for part in runs[0]}
               for label, runs in samples.items()}
    reference = medians[labels[0]]
    parts = list(reference)
    width = max(len(p) for p in parts) + 2
    print(f"prefill {args.tokens} tokens, logits_to_keep={args.logits_to_keep}, threads {torch.get_num_threads()}, "
          f"median of {args.repeats} (ms; ratio vs {labels[0]})")
    print(" " * width + "".join(f"{label[-28:]:>32}" for label in labels))
    for part in parts:
        cells = []
        for label in labels:
            value = medians[label].get(part, 0.0)
            ratio = value / reference[part] if reference.get(part) else float("nan")
            cells.append(f"{1000 * value:>22.1f} (×{ratio:5.2f})")
        print(f"{part:<{width}}" + "".join(cells))
    write_json({"kind": "profile_prefill", "settings": {"tokens": args.tokens, "repeats": args.repeats,
                                                        "warmup": args.warmup, "logits_to_keep": args.logits_to_keep,
                                                        "models": args.models},
                "machine": machine_info("cpu"), "median_seconds": medians, "samples": samples}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
