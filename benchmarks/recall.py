"""Linearized models that remember: recall beyond the window, against the training-free baselines.

One table, SmolLM2-135M, every row measured in this run:

    original           the softmax model
    <preset>           each training-free preset of --presets (default swa-sinks: sliding window 64 + 4 sinks, no
                       linear part; swa-sinks-cache: + a sparse cache of 256 keys per layer and kv head)
    <trained>          each trained hybrid given with --trained LABEL=DIR (e.g. quality=runs/recall/quality)
    <trained>+s4       + 4 attention sinks (with --sinks-row)       (api.set_recall, training-free)
    <trained>+s4+mM    + a sparse cache of M keys per layer and kv head (LoLA-style), for each M in --sparse
    <trained>+kK       K layers given their softmax back, ranked by recall gain on probes hidden in wiki-calib
                       (api.keep_softmax_for_recall, training-free), for each K in --keep
    <trained>+kK+s4+mM both
    <preset>+rK        a --presets row with K softmax layers kept by retrieval score (keep_softmax_by="retrieval":
                       the original attention's share on keys hidden in wiki-calib, ranked before any training),
                       for each K in --preset-keep
    <preset>+LAYERS    a --presets row with softmax kept in the given layers (--preset-layers 7,8,18,20,21: rows
                       <preset>+l7-8-18-20-21), e.g. to test a selection before a criterion finds it
    <extra>            a model directory as it is (--extra LABEL=DIR)

Per row: wiki-eval perplexity at seq 512 (first 4096 tokens) and 2048 (first 8192 tokens); passkey at
--passkey lengths (depths 0.1 / 0.5 / 0.9 x --trials keys each; --trials-at LENGTH=N changes N at a
length; --row-trials LABEL@LENGTH=N at a length of one row); the multi-key variant (--keys labelled keys,
one asked; depths x --multikey-trials) at --multikey lengths; then (unless --rows-only) one interleaved eager decode
benchmark (eval.bench_decode, batch 1, dynamic cache, contexts --contexts): tokens/s and the bytes of
the filled cache at every context (every tensor reachable from it). A finished row is kept in
OUT/rows/ and skipped when the script runs again.

    python benchmarks/recall.py --trained quality=runs/recall/quality --out runs/recall \\
        --json benchmarks/results/recall.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from common import eval_blocks, machine_info, perplexities
from retrofitter.api import (keep_softmax_for_recall, linearize, load, load_model, recall_probes, restore_softmax_layers,
                             load_tokenizer, set_recall)
from retrofitter.config import LinearizeConfig
from retrofitter.eval.bench_decode import bench_decode
from retrofitter.eval.passkey import passkey_accuracy


PROBE_TOKENS = 4096  # retrieval probes of the +rK rows: the needle far beyond the window


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def kept_layers(directory: str, count: int, tokenizer, out: Path) -> list[int]:
    """The ``count`` layers ranked first by recall gain (computed once per model and count, then read back)."""
    path = out / "rows" / f"keep-{Path(directory).name}-{count}.json"
    if not path.exists():
        model = load(directory)[0]
        report = keep_softmax_for_recall(model, recall_probes(tokenizer), count, progress=True)  # 4 x 1024, wiki-calib
        path.write_text(json.dumps(report, indent=2))
    return json.loads(path.read_text())["restored_softmax_layers"]


def passkey_by_length(model, tokenizer, lengths, trials_at: dict) -> dict:
    """Passkey accuracy per length, each with its own number of keys per depth (one seed per length)."""
    runs = {str(n): passkey_accuracy(model, tokenizer, context_lengths=(n,), trials=trials_at[n], seed=n, progress=True)
            for n in lengths}
    return {"by_context": {n: run["by_context"][n] for n, run in runs.items()},
            "trials_per_length": {n: len(run["trials"]) for n, run in runs.items()},
            "settings": {"context_lengths": list(lengths)}, "runs": runs}


def build(spec: tuple, model_name: str, tokenizer, out: Path):
    kind, *rest = spec
    if kind == "original":
        return load_model(model_name)[0]
    if kind == "preset":
        name, keep, *layers = rest
        model = load_model(model_name)[0]
        extra = {"keep_softmax_top": keep, "keep_softmax_by": "retrieval", "probe_tokens": PROBE_TOKENS} if keep else {}
        if layers:
            extra["keep_softmax_layers"] = tuple(layers[0])
        config = LinearizeConfig.preset(name, **extra)
        probes = (recall_probes(tokenizer, context_tokens=config.probe_tokens or config.seq_len)  # 4 probes, wiki-calib
                  if config.keep_softmax_top and config.keep_softmax_by != "mse" else None)
        _, report = linearize(model, config, progress=False, recall_probes=probes)
        if config.keep_softmax_top:
            print(f"[recall] kept softmax layers {report['restored_softmax_layers']} "
                  f"(by {report['recall_ranking']['by']})", flush=True)
        return model
    directory, sinks, cache, keep = rest
    layers = kept_layers(directory, keep, tokenizer, out) if keep else []
    model = load(directory)[0]
    if layers:
        restore_softmax_layers(model, layers)
    if sinks is not None:  # None: the directory's own settings
        set_recall(model, sinks, cache)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--trained", action="append", default=[], metavar="LABEL=DIR", help="a trained hybrid")
    parser.add_argument("--extra", action="append", default=[], metavar="LABEL=DIR",
                        help="a model directory evaluated as it is (e.g. a `recall` output healed afterwards)")
    parser.add_argument("--presets", default="swa-sinks", help="comma-separated training-free linearize presets")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--sinks-row", action="store_true", help="also a row with the sinks alone")
    parser.add_argument("--sparse", type=ints, default=(64, 256), help="sparse-cache sizes to add to each trained row")
    parser.add_argument("--keep", type=ints, default=(4,), help="softmax layers kept by recall gain (rows +kK)")
    parser.add_argument("--preset-keep", type=ints, default=(), help="softmax layers kept by retrieval score in "
                        "each --presets row (rows <preset>+rK)")
    parser.add_argument("--preset-layers", type=ints, action="append", default=[],
                        help="softmax layers kept as given in each --presets row (rows <preset>+l<layers>)")
    parser.add_argument("--passkey", type=ints, default=(2048, 4096, 8192))
    parser.add_argument("--trials", type=int, default=7, help="keys per length and depth (3 depths)")
    parser.add_argument("--trials-at", default="", metavar="LENGTH=N,...",
                        help="keys per depth at the given lengths instead of --trials (e.g. 4096=7,8192=2)")
    parser.add_argument("--row-trials", default="", metavar="LABEL@LENGTH=N,...",
                        help="keys per depth for one row at one length (e.g. swa-sinks-cache@8192=7)")
    parser.add_argument("--multikey", type=ints, default=(4096, 8192))
    parser.add_argument("--keys", type=int, default=2, help="labelled keys of the multi-key variant (SmolLM2-135M "
                        "itself recalls 2 of them, not 3)")
    parser.add_argument("--multikey-trials", type=int, default=4)
    parser.add_argument("--contexts", type=ints, default=(4096, 8192))
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows-only", action="store_true",
                        help="measure and keep the rows, skip the decode benchmark (a later run without it adds it)")
    parser.add_argument("--only", default="", help="comma-separated row labels (default: all)")
    parser.add_argument("--out", type=Path, default=Path("runs/recall"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    trials_at = {n: args.trials for n in args.passkey}
    trials_at.update({int(k): int(v) for k, _, v in (item.partition("=") for item in args.trials_at.split(",") if item)})
    row_trials: dict[str, dict[int, int]] = {}
    for item in filter(None, args.row_trials.split(",")):
        where, _, count = item.partition("=")
        label, _, length = where.rpartition("@")
        row_trials.setdefault(label, {})[int(length)] = int(count)
    (args.out / "rows").mkdir(parents=True, exist_ok=True)

    rows: dict[str, tuple] = {"original": ("original",)}
    for name in filter(None, args.presets.split(",")):
        if LinearizeConfig.preset(name).transfer_tokens or LinearizeConfig.preset(name).lora_tokens:
            parser.error(f"--presets takes training-free presets; {name!r} trains (give its output with --trained)")
        rows[name] = ("preset", name, 0)
        for keep in args.preset_keep:
            rows[f"{name}+r{keep}"] = ("preset", name, keep)
        for layers in args.preset_layers:
            rows[f"{name}+l{'-'.join(map(str, layers))}"] = ("preset", name, 0, list(layers))
    for item in args.trained:
        name, _, directory = item.partition("=")
        rows[name] = ("trained", directory, 0, 0, 0)
        if args.sinks_row:
            rows[f"{name}+s{args.sinks}"] = ("trained", directory, args.sinks, 0, 0)
        for size in args.sparse:
            rows[f"{name}+s{args.sinks}+m{size}"] = ("trained", directory, args.sinks, size, 0)
        for keep in args.keep:
            rows[f"{name}+k{keep}"] = ("trained", directory, 0, 0, keep)
            rows[f"{name}+k{keep}+s{args.sinks}+m{args.sparse[0]}"] = ("trained", directory, args.sinks,
                                                                      args.sparse[0], keep)
    for item in args.extra:
        name, _, directory = item.partition("=")
        rows[name] = ("trained", directory, None, None, 0)
    if args.only:
        rows = {k: v for k, v in rows.items() if k in args.only.split(",") or k == "original"}

    tokenizer = load_tokenizer(args.model)
    blocks = {512: eval_blocks(tokenizer, ["wiki-eval"], 512, 4096), 2048: eval_blocks(tokenizer, ["wiki-eval"], 2048, 8192)}
    results = {}
    for label, spec in rows.items():
        path = args.out / "rows" / f"{label}.json"
        if path.exists():
            results[label] = json.loads(path.read_text())
            continue
        print(f"[recall] {label}", flush=True)
        start = time.perf_counter()
        model = build(spec, args.model, tokenizer, args.out)
        row = {"spec": list(spec), "ppl": {str(n): perplexities(model, b)["wiki-eval"] for n, b in blocks.items()}}
        print(f"[recall] {label} ppl {row['ppl']}", flush=True)
        row["passkey"] = passkey_by_length(model, tokenizer, args.passkey, {**trials_at, **row_trials.get(label, {})})
        print(f"[recall] {label} passkey {row['passkey']['by_context']}", flush=True)
        if args.multikey:
            row["multikey"] = passkey_accuracy(model, tokenizer, context_lengths=args.multikey, keys=args.keys,
                                               trials=args.multikey_trials, seed=1, progress=True)
            print(f"[recall] {label} multikey {row['multikey']['by_context']}", flush=True)
        row["seconds"] = time.perf_counter() - start
        path.write_text(json.dumps(row, indent=2))
        results[label] = row
        del model
        gc.collect()

    if args.rows_only:
        return
    models = [(label, build(spec, args.model, tokenizer, args.out)) for label, spec in rows.items()]
    speed = bench_decode(models, modes=("eager",), batch_sizes=(1,), contexts=args.contexts, prefill_len=0,
                         decode_tokens=args.decode_tokens, cache="dynamic", repeats=args.repeats, warmup=1,
                         floor=False, progress=True)
    record = {"kind": "recall", "settings": {k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path)
                                                 else v) for k, v in vars(args).items()},
              "machine": machine_info(), "rows": results, "bench_decode": speed}
    text = json.dumps(record, indent=2)
    (args.out / "recall.json").write_text(text)
    if args.json:
        args.json.write_text(text)
    print(table(record))


def table(record: dict) -> str:
    """Markdown: one row per model, ratios against the original's row."""
    rows, speed = record["rows"], record["bench_decode"]["results"]["eager"]["1"]
    base = rows["original"]
    contexts = record["bench_decode"]["settings"]["contexts"]
    lengths = record["rows"]["original"]["passkey"]["settings"]["context_lengths"]
    multi = (record["rows"]["original"].get("multikey") or {}).get("settings", {}).get("context_lengths", [])
    head = (["model", "ppl @512", "@2048"] + [f"passkey {n}" for n in lengths] + [f"multi-key {n}" for n in multi]
            + [f"cache @{n}" for n in contexts] + [f"decode tok/s @{n}" for n in contexts])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, row in rows.items():
        cells = [label] + [f"{row['ppl'][n]:.2f} ({row['ppl'][n] / base['ppl'][n]:.3f}×)" for n in ("512", "2048")]
        cells += [f"{row['passkey']['by_context'][str(n)]:.0%} ({_trials(row['passkey'], n)})" for n in lengths]
        cells += [f"{row['multikey']['by_context'][str(n)]:.0%} ({_trials(row['multikey'], n)})"
                  if str(n) in row.get("multikey", {}).get("by_context", {}) else "—" for n in multi]
        entry = speed[label]["decode"]
        ref = speed["original"]["decode"]
        cells += [f"{entry[str(n)]['cache_bytes'] / 2**20:.1f} MiB ({entry[str(n)]['cache_bytes'] / ref[str(n)]['cache_bytes']:.3f}×)"
                  for n in contexts]
        cells += [f"{entry[str(n)]['tokens_per_s']['median']:.1f} "
                  f"({entry[str(n)]['tokens_per_s']['median'] / ref[str(n)]['tokens_per_s']['median']:.2f}×)"
                  for n in contexts]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _trials(passkey: dict, length: int) -> int:
    """Trials behind the accuracy at ``length`` (rows of older runs ran every length with the same count)."""
    if "trials_per_length" in passkey:
        return passkey["trials_per_length"][str(length)]
    return sum(1 for trial in passkey["trials"] if trial["context"] == length)


if __name__ == "__main__":
    main()
