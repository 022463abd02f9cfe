"""MLA by conversion on the default model: perplexity against KV bytes (training-free and healed), decode speed.

Every point is the public command line, one after another on the same machine:
``retrofitter eval`` (the original), ``retrofitter mla --kv-ratio K`` for each K, ``retrofitter heal`` of the
``--heal`` point with the default heal budget, and ``retrofitter bench`` of the original against the
converted and healed models (interleaved repeats). Evaluation: wiki-eval, austen and a held-out text of
another domain (``--held-out``, default the GPL-3 licence text that Debian ships), seq 512. A finished point
is skipped when the script runs again; the summary goes to ``--json``.

    python benchmarks/mla_frontier.py --kv-ratios 0.5,0.25,0.125 --heal 0.25 --out runs/mla_frontier

``--mla-args`` / ``--heal-args`` pass further flags (``--mla-args=--unrotated-fit=none`` converts as before the
fitted query maps; ``--heal-args="--lora-rank 64 --lora-alpha 128 --lr 1e-3"`` the recommended adapter);
``--passkey 2048,4096`` adds ``retrofitter eval --passkey`` of the healed model; ``--no-bench`` skips the speed run.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from cli_runner import ROOT, run_once, run_retrofitter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--kv-ratios", default="0.5,0.25,0.125")
    parser.add_argument("--heal", default="0.25", help="the kv ratio healed afterwards ('' for none)")
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--rope-selection", default="progression",
                        help="passed to `retrofitter mla` (results §13's table: score, the default then)")
    parser.add_argument("--max-eval-tokens", type=int, default=4096)
    parser.add_argument("--held-out", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--contexts", default="512,2048,4096")
    parser.add_argument("--mla-args", default="", help="more `retrofitter mla` flags, one string")
    parser.add_argument("--heal-args", default="", help="more `retrofitter heal` flags, one string")
    parser.add_argument("--passkey", default="", help="context lengths of a passkey run on the healed model")
    parser.add_argument("--passkey-trials", type=int, default=4, help="random keys per depth (3 depths)")
    parser.add_argument("--no-bench", action="store_true", help="skip `retrofitter bench`")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/mla_frontier"))
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "mla_frontier.json")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "log.txt"
    corpora = ",".join(["wiki-eval", "austen"] + ([args.held_out] if args.held_out else []))
    evaluation = ["--eval", corpora, "--max-eval-tokens", str(args.max_eval_tokens), "--quiet"]

    def point(name: str, command: list[str]) -> dict:
        return run_once(args.out / f"{name}.json", command, threads=args.threads, log=log)

    points = {"original": point("original", ["eval", args.model, "--ppl", corpora, "--max-eval-tokens",
                                             str(args.max_eval_tokens), "--quiet"])}
    models = [args.model]
    for kv in [k for k in args.kv_ratios.split(",") if k]:
        out = args.out / f"mla-{kv}"
        points[f"mla {kv}"] = point(f"mla-{kv}", ["mla", args.model, "--kv-ratio", kv, "--calib-samples",
                                                  str(args.calib_samples), "--rope-selection", args.rope_selection,
                                                  "--out", str(out), *shlex.split(args.mla_args), *evaluation])
        models.append(str(out))
    if args.heal:
        healed = args.out / f"mla-{args.heal}-healed"
        points[f"mla {args.heal} healed"] = point(f"mla-{args.heal}-healed", [
            "heal", str(args.out / f"mla-{args.heal}"), "--out", str(healed), *shlex.split(args.heal_args),
            *evaluation])
        if args.passkey:
            points[f"mla {args.heal} healed passkey"] = point(f"mla-{args.heal}-healed-passkey", [
                "eval", str(healed), "--passkey", args.passkey, "--passkey-trials", str(args.passkey_trials), "--quiet"])
    bench = args.out / "bench.json"
    if not bench.exists() and not args.no_bench:
        run_retrofitter(["bench", args.model, str(args.out / f"mla-{args.heal or args.kv_ratios.split(',')[0]}"),
                         "--contexts", args.contexts, "--decode-tokens", "16", "--repeats", "3", "--quiet",
                         "--json", str(bench)], threads=args.threads, log=log)
    summary = {"settings": vars(args) | {"out": str(args.out), "json": str(args.json)},
               "points": {name: {"ppl": p.get("ppl"), "passkey": p.get("passkey"), "kv_bytes_per_token": p.get("kv_bytes_per_token"),
                                 "params": p.get("params"), "mla": p.get("mla"), "heal": p.get("heal", {}).get("steps"),
                                 "ppl_over_original": p.get("ppl_over_original"), "wall_s": p.get("wall_s")}
                          for name, p in points.items()},
               "bench": json.loads(bench.read_text()) if bench.exists() else None}
    args.json.write_text(json.dumps(summary, indent=2, sort_keys=True, default=str))
    reference = points["original"]["ppl"]
    print(f"{'model':<22} {'KV B/token':>10}  " + "  ".join(f"{c[:12]:>12}" for c in reference))
    for name, p in points.items():
        if p.get("passkey"):
            print(f"{name:<22} passkey {p['passkey'].get('by_context')}")
            continue
        print(f"{name:<22} {p.get('kv_bytes_per_token') or 0:>10}  "
              + "  ".join(f"{p['ppl'][c]:>7.2f} ({p['ppl'][c] / reference[c]:.2f}x)" for c in reference))


if __name__ == "__main__":
    main()
