"""Both conversions in one model: compressed MLPs + linearized attention, healed once from the original.

Every step is the public command line, so the table is what a user gets:

    lin       retrofitter linearize ORIGINAL --preset cpu-small --lora-loss kl          (linearized alone)
    mlp       retrofitter compress ORIGINAL --ratio R --targets gate,up,down             (compressed MLPs alone)
    lin-mlp   retrofitter linearize mlp --preset cpu-small --lora-tokens 0               (stage 1 on the compressed model)
    combined  retrofitter heal lin-mlp --tokens T --seq-len 2048                         (one distillation from the original:
                                                                                          LoRA on attention and MLP factors)

then ``retrofitter eval`` of each (perplexity at 512 on wiki-eval and austen, at 2048 on wiki-eval,
passkey retrieval at 2048 / 4096 for the original, the linearized and the combined model) and one
interleaved ``retrofitter bench`` of all of them. A finished step is skipped when the script is run
again (its output exists), so an interrupted run resumes.

    python benchmarks/combined_model.py --out runs/combined --json benchmarks/results/combined_model.json
    # SmolLM2-135M on 2 cores: ~75 min
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cli_runner import ROOT, run_retrofitter


def retrofitter(*args: str, log: Path) -> float:
    return run_retrofitter(list(args), log=log)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--ratio", type=float, default=0.2, help="compression ratio of the MLP projections")
    parser.add_argument("--heal-tokens", type=int, default=49_152)
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/combined"))
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "combined_model.json")
    args = parser.parse_args()
    out, log = args.out, args.out / "log.txt"
    (out / "results").mkdir(parents=True, exist_ok=True)
    seconds = json.loads((out / "seconds.json").read_text()) if (out / "seconds.json").exists() else {}

    def step(name: str, *command: str) -> None:
        if (out / name).exists():
            return
        seconds[name] = retrofitter(*command, "--out", str(out / name), "--no-eval", log=log)
        (out / "seconds.json").write_text(json.dumps(seconds, indent=2))

    step("lin", "linearize", args.model, "--preset", "cpu-small", "--lora-loss", "kl")
    step("mlp", "compress", args.model, "--ratio", str(args.ratio), "--targets", "gate,up,down",
         "--calib-samples", str(args.calib_samples))
    step("lin-mlp", "linearize", str(out / "mlp"), "--preset", "cpu-small", "--lora-tokens", "0")
    step("combined", "heal", str(out / "lin-mlp"), "--tokens", str(args.heal_tokens), "--seq-len", "2048")

    models = {"original": args.model, "linearized": str(out / "lin"), "compressed-mlp": str(out / "mlp"),
              "linearized+compressed (before heal)": str(out / "lin-mlp"), "combined": str(out / "combined")}
    passkey = {"original", "linearized", "combined"}
    for label, path in models.items():
        stem = label.split(" ")[0]
        short, long = out / "results" / f"{stem}-512.json", out / "results" / f"{stem}-2048.json"
        if not short.exists():
            retrofitter("eval", path, "--ppl", "wiki-eval,austen", "--seq-len", "512", "--max-eval-tokens", "4096",
                        "--quiet", "--json", str(short), log=log)
        if not long.exists():
            retrofitter("eval", path, "--ppl", "wiki-eval", "--seq-len", "2048", "--max-eval-tokens", "8192",
                        "--quiet", "--json", str(long), *(["--passkey", "2048,4096"] if label in passkey else []),
                        log=log)
    bench = out / "results" / "bench.json"
    if not bench.exists():
        retrofitter("bench", args.model, str(out / "lin"), str(out / "mlp"), str(out / "combined"), "--contexts",
                    "512,2048,4096", "--decode-tokens", "16", "--repeats", "2", "--threads", str(args.threads),
                    "--quiet", "--json", str(bench), log=log)
    retrofitter("report", str(out / "results"), "--out", str(out / "report"), log=log)

    rows = {}
    for label in models:
        stem = label.split(" ")[0]
        short, long = (json.loads((out / "results" / f"{stem}-{n}.json").read_text()) for n in (512, 2048))
        rows[label] = {"ppl@512": short["ppl"], "ppl@2048": long["ppl"], "params": short["params"],
                       "kv_bytes_per_token": short["kv_bytes_per_token"],
                       "state_bytes_per_sequence": short.get("state_bytes_per_sequence", 0),
                       "stored_bytes": short["bytes"]["stored"], "passkey": long.get("passkey", {}).get("by_context")}
    measured = json.loads(bench.read_text())
    for entry in measured["models"]:
        label = next((k for k, v in models.items() if v == entry["model"] or Path(v).name == entry["label"]), None)
        if label in rows:
            rows[label]["decode_tokens_per_s"] = {n: d["tokens_per_s"]["median"] for n, d in entry["decode"].items()}
            rows[label]["prefill_s"] = entry["prefill"]["latency_s"]["median"]
            rows[label]["cache_bytes"] = {n: d["cache_bytes"] for n, d in entry["decode"].items()}
    result = {"model": args.model, "mlp_ratio": args.ratio, "heal_tokens": args.heal_tokens,
              "calib_samples": args.calib_samples, "threads": args.threads, "step_seconds": seconds, "rows": rows,
              "bench_settings": measured.get("settings"), "machine": measured.get("machine")}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
