"""How much calibration is enough: the default compression at one ratio for several calibration sizes.

For each size N (blocks of ``--seq-len`` tokens from wiki-calib, the first N of the same cut), the
default compression (``CompressConfig(ratio=R)``: asvd-rootcov, global fisher allocation) runs through
``retrofitter.api.compress`` and the result is evaluated on wiki-eval and austen (seq 512). Also
measured: the compression wall time, its ratio to one plain forward over the same calibration tokens
(timed just before, outside the compression), and the process peak RSS at the end of each run.

    python benchmarks/calibration_sweep.py --sizes 16,32,64,128 --ratio 0.2

Writes benchmarks/results/calibration_sweep.json and .md.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import time
from pathlib import Path

import torch

from common import eval_blocks, machine_info, perplexities
from retrofitter.api import compress, load_model, write_json
from retrofitter.config import CompressConfig
from retrofitter.data.blocks import token_blocks
from retrofitter.data.corpora import load_text

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sizes", default="16,32,64,128")
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--max-eval-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(RESULTS / "calibration_sweep.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    original, tokenizer = load_model(args.model)
    sizes = [int(s) for s in args.sizes.split(",")]
    calibration = token_blocks(tokenizer, load_text("wiki-calib"), args.seq_len, max_blocks=max(sizes))
    if calibration.shape[0] < max(sizes):
        raise SystemExit(f"wiki-calib gives only {calibration.shape[0]} blocks of {args.seq_len} tokens")
    blocks = eval_blocks(tokenizer, ("wiki-eval", "austen"), args.seq_len, args.max_eval_tokens)
    config = CompressConfig(ratio=args.ratio)
    payload = {"settings": {"model": args.model, "ratio": args.ratio, "seq_len": args.seq_len,
                            "max_eval_tokens": args.max_eval_tokens, "config": config.to_dict(),
                            "threads": torch.get_num_threads(), "machine": machine_info(),
                            "date": datetime.datetime.now().isoformat(timespec="seconds")},
               "original": perplexities(original, blocks), "rows": []}
    print("original", payload["original"], flush=True)
    for size in sizes:
        t0 = time.perf_counter()  # one plain forward over the same calibration tokens: the cost unit
        with torch.no_grad():
            for start in range(0, size, config.batch_size):
                original(calibration[start:min(size, start + config.batch_size)])
        forward_seconds = time.perf_counter() - t0
        model = copy.deepcopy(original)
        t0 = time.perf_counter()
        _, report = compress(model, config, calibration[:size], progress=False)
        seconds = time.perf_counter() - t0
        row = {"calib_blocks": size, "calib_tokens": size * args.seq_len, "compress_s": seconds,
               "calibration_forward_s": forward_seconds, "compress_over_forward": seconds / forward_seconds,
               "peak_rss_mb": report.get("peak_rss_mb"), "targets_reduction": report["targets_reduction"],
               **{f"ppl_{k}": v for k, v in perplexities(model, blocks).items()}}
        payload["rows"].append(row)
        print(json.dumps(row), flush=True)
        write_json(payload, args.out)
        del model
    Path(args.out).with_suffix(".md").write_text(markdown(payload))
    print(markdown(payload))


def markdown(payload: dict) -> str:
    s = payload["settings"]
    o = payload["original"]
    lines = [f"Default compression ({s['config']['method']}, allocation {s['config']['allocation']} "
             f"{s['config']['allocation_weighting']}, statistics {s['config']['statistics']}) at ratio {s['ratio']}; "
             f"eval {s['max_eval_tokens']} tokens per corpus at seq {s['seq_len']}; {s['threads']} threads; {s['date']}.",
             f"Original: wiki-eval {o['wiki-eval']:.2f}, austen {o['austen']:.2f}.", "",
             "| calibration blocks × 512 | ppl wiki-eval | ppl austen | compress s | × one calibration forward | "
             "peak RSS MiB |", "|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        lines.append(f"| {r['calib_blocks']} | {r['ppl_wiki-eval']:.2f} | {r['ppl_austen']:.2f} | {r['compress_s']:.0f} | "
                     f"{r['compress_over_forward']:.1f} | {r['peak_rss_mb']:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
