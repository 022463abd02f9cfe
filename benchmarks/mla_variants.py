"""MLA conversion variants side by side: perplexity (and optionally passkey) of `convert_to_mla` with settings.

Each variant is ``NAME:field=value,field=value`` over ``MLAConfig``'s fields (docs/mla.md); one process runs
them one after another from a fresh copy of the model, on the same calibration blocks (the first
``--calib-samples`` × 512 tokens of wiki-calib) and the same evaluation cut (``--max-eval-tokens`` of each
corpus, seq 512). A variant already in ``--json`` is skipped (the file resumes).

    python benchmarks/mla_variants.py --json benchmarks/results/mla_variants.json \\
        --variant default: --variant no-fit:unrotated_fit=none \\
        --variant rotation-only:kv_ratio=1.0,rope_fraction=0.0833 --passkey 1024,2048
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from common import eval_blocks, machine_info, perplexities

from retrofitter import MLAConfig
from retrofitter.api import convert_to_mla, load_model
from retrofitter.data.blocks import calibration_blocks
from retrofitter.data.corpora import load_text
from retrofitter.eval.passkey import passkey_accuracy


def parse_variant(text: str) -> tuple[str, MLAConfig]:
    """``NAME:field=value,...`` -> (name, MLAConfig); values take the type of the field's default."""
    name, _, settings = text.partition(":")
    defaults = MLAConfig()
    fields = {f.name for f in dataclasses.fields(MLAConfig)}
    values = {}
    for item in [s for s in settings.split(",") if s]:
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"unknown MLAConfig field {key!r} in {text!r}; fields: {sorted(fields)}")
        values[key] = type(getattr(defaults, key))(value)
    return name, MLAConfig(**values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variant", action="append", required=True, help="NAME:field=value,... (repeatable)")
    parser.add_argument("--eval", default="wiki-eval", help="comma-separated corpora")
    parser.add_argument("--max-eval-tokens", type=int, default=4096)
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--passkey", default="", help="context lengths (3 depths x --passkey-trials keys each)")
    parser.add_argument("--passkey-trials", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    variants = [parse_variant(v) for v in args.variant]
    results = json.loads(args.json.read_text()) if args.json.exists() else {"machine": machine_info(), "variants": {}}
    _, tokenizer = load_model(args.model)
    calibration = calibration_blocks(tokenizer, load_text("wiki-calib"), 512, args.calib_samples)
    blocks = eval_blocks(tokenizer, args.eval.split(","), 512, args.max_eval_tokens)
    contexts = tuple(int(c) for c in args.passkey.split(",") if c)
    for name, config in variants:
        if name in results["variants"]:
            continue
        model, _ = load_model(args.model)
        start = time.perf_counter()
        _, report = convert_to_mla(model, config, calibration, progress=False)
        row = {"config": config.to_dict(), "convert_s": time.perf_counter() - start,
               "ppl": perplexities(model, blocks), "kv_rank": report["kv_rank"], "rope_dim": report["rope_dim"],
               "rope_step": report["rope_step"]}
        if contexts:
            found = passkey_accuracy(model, tokenizer, context_lengths=contexts, trials=args.passkey_trials)
            row["passkey"] = {key: found[key] for key in ("accuracy", "by_context", "settings")}
        results["variants"][name] = row
        args.json.write_text(json.dumps(results, indent=2, sort_keys=True))
        print(name, json.dumps({k: row[k] for k in ("ppl", "passkey") if k in row}), flush=True)
    results["settings"] = {k: str(v) for k, v in vars(args).items()}
    args.json.write_text(json.dumps(results, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
