"""Perplexity by position inside long windows: where a model's loss climbs with the distance it must reach.

Each model reads the same windows of ``--seq-len`` tokens (the cut of ``retrofitter eval``); the next-token NLL of
every position is averaged over the windows, then over each span of ``--edges`` (token i predicts token i + 1), and
the record holds exp(mean NLL) per span. A model trained on 512-token blocks that does not carry past them shows a
flat curve up to 512 and a climb after it; the original model's curve stays flat.

    python benchmarks/position_ppl.py runs/mla-0.25-q runs/mla-0.25-q-pose --seq-len 2048 --max-eval-tokens 8192 \\
        --json benchmarks/results/mla_position_ppl.json
"""

from __future__ import annotations

import argparse
import time

import torch
from common import eval_blocks, machine_info

from retrofitter.api import load_model, write_json


def position_nll(model, blocks: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL per position [seq_len − 1] over ``blocks`` [n, seq_len] (float64 sums)."""
    total = torch.zeros(blocks.shape[1] - 1, dtype=torch.float64)
    with torch.no_grad():
        for block in blocks:
            logits = model(block[None]).logits[0, :-1].float()  # [L − 1, vocab]
            total += torch.nn.functional.cross_entropy(logits, block[1:], reduction="none").double()
    return total / blocks.shape[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="models (aliases, HF ids or saved dirs); the baseline is added first")
    parser.add_argument("--baseline", default="smollm2-135m")
    parser.add_argument("--corpus", default="wiki-eval")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--max-eval-tokens", type=int, default=8192)
    parser.add_argument("--edges", default="0,128,256,512,768,1024,1536,2047",
                        help="span boundaries over positions (the last at most seq-len − 1)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    edges = [int(e) for e in args.edges.split(",")]
    if edges != sorted(set(edges)) or edges[0] < 0 or edges[-1] > args.seq_len - 1:
        parser.error(f"--edges must rise strictly within 0 … {args.seq_len - 1}, got {args.edges}")
    start = time.perf_counter()
    _, tokenizer = load_model(args.baseline)
    blocks = eval_blocks(tokenizer, [args.corpus], args.seq_len, args.max_eval_tokens)[args.corpus]
    spans = [f"{a}-{b}" for a, b in zip(edges, edges[1:])]
    record = {"settings": {"corpus": args.corpus, "seq_len": args.seq_len, "windows": int(blocks.shape[0]),
                           "spans": spans, "threads": torch.get_num_threads()},
              "machine": machine_info(), "models": {}}
    print(f"{'model':<45} " + " ".join(f"{s:>9}" for s in spans))
    for path in [args.baseline] + args.models:
        model, _ = load_model(path)
        nll = position_nll(model, blocks)
        ppl = {s: float(nll[a:b].mean().exp()) for s, a, b in zip(spans, edges, edges[1:])}
        record["models"][path] = {"ppl_by_span": ppl, "ppl": float(nll.mean().exp())}
        print(f"{path[-45:]:<45} " + " ".join(f"{ppl[s]:>9.2f}" for s in spans), flush=True)
        del model
    record["seconds"] = time.perf_counter() - start
    write_json(record, args.json)


if __name__ == "__main__":
    main()
