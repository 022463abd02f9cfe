"""MLA healed with growing budgets: perplexity and passkey against healing tokens, on any device.

One ``retrofitter mla --kv-ratio K`` conversion, then one ``retrofitter heal`` per budget from that same
converted model (each its own warm-up and cosine schedule, as a user with that budget would run it), each
evaluated on wiki-eval, austen and a held-out text at seq 512 and by passkey retrieval; the original is
evaluated the same way in the same run. Budgets are ``TOKENS:BATCH:SEQ[@MINUTES]`` (the first of the token
and time budgets spent stops a run). The summary JSON is rewritten after every point, so a run cut short
keeps what it finished; a finished point is skipped when the script runs again.

    # on a GPU (results §13b): the default heal budget, then larger ones capped by minutes
    python benchmarks/mla_heal_budget.py --device cuda --budgets 65536:1:512,16777216:16:512@3
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from cli_runner import ROOT, run_once


def parse_budget(text: str) -> dict:
    """``TOKENS:BATCH:SEQ[@MINUTES]`` → the heal flags of one budget."""
    spec, _, minutes = text.partition("@")
    try:
        tokens, batch, seq = (int(part) for part in spec.split(":"))
        minutes_value = float(minutes) if minutes else 0.0
    except ValueError:
        raise SystemExit(f"a budget is TOKENS:BATCH:SEQ[@MINUTES], e.g. 65536:1:512 or 16777216:16:512@3; got {text!r}")
    return {"tokens": tokens, "batch_size": batch, "seq_len": seq, "minutes": minutes_value}


def budget_name(budget: dict) -> str:
    name = f"heal-{budget['tokens']}-b{budget['batch_size']}-s{budget['seq_len']}"
    return name + (f"-m{budget['minutes']:g}" if budget["minutes"] else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--kv-ratio", default="0.25")
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--budgets", default="65536:1:512", help="comma-separated TOKENS:BATCH:SEQ[@MINUTES]")
    parser.add_argument("--lr", default="5e-4", help="heal --lr of every budget")
    parser.add_argument("--eval", default="wiki-eval,austen,/usr/share/common-licenses/GPL-3")
    parser.add_argument("--max-eval-tokens", type=int, default=4096)
    parser.add_argument("--passkey", default="2048,4096,8192", help="passkey lengths ('' for none)")
    parser.add_argument("--passkey-trials", type=int, default=4, help="keys per length and depth (3 depths)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("runs/mla_heal_budget"))
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "mla_heal_budget.json")
    args = parser.parse_args()
    budgets = [parse_budget(b) for b in args.budgets.split(",") if b]
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "log.txt"
    device = ["--device", args.device, "--quiet"]
    evaluation = ["--max-eval-tokens", str(args.max_eval_tokens), *device]
    passkey = ["--passkey", args.passkey, "--passkey-trials", str(args.passkey_trials)] if args.passkey else []
    summary = {"settings": {k: str(v) for k, v in vars(args).items()}, "points": {}}

    def record(name: str, command: list[str]) -> dict:
        return run_once(args.out / f"{name}.json", command, threads=args.threads, log=log)

    def point(name: str, model: str, quality: dict, extra: dict | None = None) -> None:
        recall = record(f"{name}-passkey", ["eval", model, "--ppl", "wiki-eval", "--max-eval-tokens", "512",
                                                  *passkey, *device]) if passkey else {}
        summary["points"][name] = {"ppl": quality.get("ppl"), "passkey": recall.get("passkey"),
                                   "kv_bytes_per_token": quality.get("kv_bytes_per_token"),
                                   "wall_s": quality.get("wall_s"), **(extra or {})}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2, sort_keys=True, default=str))
        print(f"[{time.strftime('%H:%M:%S')}] {name}: ppl {quality.get('ppl')} passkey "
              f"{(recall.get('passkey') or {}).get('by_context')}",
              flush=True)

    point("original", args.model, record("original", ["eval", args.model, "--ppl", args.eval, *evaluation]))
    converted = args.out / f"mla-{args.kv_ratio}"
    point(f"mla {args.kv_ratio}", str(converted), record(f"mla-{args.kv_ratio}", [
        "mla", args.model, "--kv-ratio", args.kv_ratio, "--calib-samples", str(args.calib_samples),
        "--out", str(converted), "--eval", args.eval, *evaluation]))
    for budget in budgets:
        name = budget_name(budget)
        healed = args.out / f"mla-{args.kv_ratio}-{name}"
        quality = record(name, ["heal", str(converted), "--out", str(healed), "--tokens", str(budget["tokens"]),
                                "--minutes", str(budget["minutes"]), "--batch-size", str(budget["batch_size"]),
                                "--seq-len", str(budget["seq_len"]), "--lr", args.lr, "--eval", args.eval,
                                *evaluation])
        heal = quality.get("heal", {})
        point(f"mla {args.kv_ratio} {name}", str(healed), quality,
              {"budget": budget, "heal_steps": heal.get("steps"), "heal_tokens": heal.get("tokens"),
               "stopped_by": heal.get("stopped_by"), "heal_seconds": heal.get("seconds")})


if __name__ == "__main__":
    main()
