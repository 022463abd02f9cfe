"""LoLCATs ``--preset cpu-small`` on the real model, with perplexity after every stage.

Runs: original -> control (the original model given the same LoRA budget on the same text) ->
swap (untrained hybrid) -> stage 1 (attention transfer) -> stage 2 (LoRA, merged), evaluating
perplexity on each ``--corpora`` at each ``--seq-lens`` (token-capped), then saves the model,
reloads it with ``retrofitter.load`` and greedy-generates a short continuation. The peak RSS of
that training run is recorded before the last part: decode speed and cache bytes of the original
and the linearized model at ``--decode-contexts`` (``retrofitter.eval.bench.bench_models``). The
JSON is rewritten after every stage, so an interrupted run still leaves its table.

    PYTHONPATH=src RETROFITTER_CACHE=/work/cache python benchmarks/linearize_cpu.py --out runs/lolcats-cpu-small
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time
from pathlib import Path

import torch

from retrofitter.api import evaluation_blocks, finetune_lora, linearize, load, load_model, save, write_json
from retrofitter.config import LINEARIZE_PRESETS, LinearizeConfig
from retrofitter.data.blocks import token_blocks
from retrofitter.data.corpora import load_text
from retrofitter.eval.accounting import account
from retrofitter.eval.bench import bench_models
from retrofitter.eval.bench_table import format_bench_table
from retrofitter.eval.perplexity import perplexity
from retrofitter.eval.resources import peak_rss_mb


def stage_perplexities(model, tokenizer, corpora, seq_lens, max_tokens) -> dict:
    """{"corpus@seq_len": ppl} on the first ``max_tokens`` tokens of each corpus."""
    table = {}
    for corpus in corpora:
        for seq_len in seq_lens:
            blocks = evaluation_blocks(tokenizer, corpus, seq_len, max_tokens)
            table[f"{corpus}@{seq_len}"] = perplexity(model, blocks, batch_size=1, progress=False).ppl
    return table


def format_table(stages: dict) -> str:
    columns = sorted({key for row in stages.values() for key in row})
    lines = ["stage        " + "  ".join(f"{c:>18}" for c in columns)]
    for stage, row in stages.items():
        lines.append(f"{stage:<12} " + "  ".join(f"{row.get(c, float('nan')):>18.2f}" for c in columns))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--preset", default="cpu-small", choices=sorted(LINEARIZE_PRESETS))
    parser.add_argument("--out", type=Path, default=Path("runs/lolcats-cpu-small"))
    parser.add_argument("--corpora", default="wiki-eval,austen")
    parser.add_argument("--seq-lens", default="512,2048")
    parser.add_argument("--eval-tokens", type=int, default=4096, help="token cap per corpus and length")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-control", action="store_true", help="skip the original + LoRA control row")
    parser.add_argument("--decode-contexts", default="512,2048,8176",
                        help="contexts of the decode benchmark ('' to skip); 8176 + 16 decoded = 8192 positions")
    parser.add_argument("--decode-tokens", type=int, default=15)
    parser.add_argument("--seq-len", type=int, default=None, help="override the preset's training block length")
    parser.add_argument("--transfer-tokens", type=int, default=None, help="override the preset's stage-1 tokens")
    parser.add_argument("--lora-tokens", type=int, default=None, help="override the preset's stage-2 tokens")
    parser.add_argument("--window", type=int, default=None, help="override the preset's softmax window")
    parser.add_argument("--keep-softmax-top", type=int, default=None, help="override the preset's keep_softmax_top")
    parser.add_argument("--sinks", type=int, default=None, help="override the preset's attention sinks")
    parser.add_argument("--sparse-cache", type=int, default=None, help="override the preset's sparse-cache size")
    parser.add_argument("--eval-stages", default="original,control,swap,transfer,lora",
                        help="stages whose perplexity is measured (each costs one evaluation pass)")
    parser.add_argument("--lora-loss", choices=("kl", "next_token"), default=None,
                        help="override the preset's stage-2 objective (kl: distillation from the original)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    corpora = [c for c in args.corpora.split(",") if c]
    seq_lens = [int(n) for n in args.seq_lens.split(",") if n]
    config = LinearizeConfig.preset(args.preset)
    overrides = {k: v for k, v in {"seq_len": args.seq_len, "transfer_tokens": args.transfer_tokens,
                                    "lora_tokens": args.lora_tokens, "lora_loss": args.lora_loss,
                                    "window": args.window, "keep_softmax_top": args.keep_softmax_top,
                                    "sinks": args.sinks, "sparse_cache": args.sparse_cache}.items()
                 if v is not None}
    if overrides:
        config = dataclasses.replace(config, **overrides)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"model": args.model, "method": "lolcats", "preset": args.preset, "config": config.to_dict(),
               "eval_tokens_cap": args.eval_tokens, "ppl_by_stage": {}, "timings_s": {}}
    json_path = args.out / "results.json"
    start = time.perf_counter()

    model, tokenizer = load_model(args.model)
    results["kv_bytes_per_token_original"] = account(model).kv_bytes_per_token

    eval_stages = {s for s in args.eval_stages.split(",") if s}

    def record(stage: str, current) -> None:
        if stage not in eval_stages:
            return
        t0 = time.perf_counter()
        results["ppl_by_stage"][stage] = stage_perplexities(current, tokenizer, corpora, seq_lens, args.eval_tokens)
        results["timings_s"][f"eval_{stage}"] = time.perf_counter() - t0
        results["timings_s"]["wall_so_far"] = time.perf_counter() - start
        results["peak_rss_mb"] = peak_rss_mb()
        write_json(results, json_path)
        print(f"[{results['timings_s']['wall_so_far']:.0f}s] {stage}: {results['ppl_by_stage'][stage]}", flush=True)

    record("original", model)
    wanted = config.transfer_tokens + config.lora_tokens
    blocks = token_blocks(tokenizer, load_text("wiki-calib"), config.seq_len, max_tokens=wanted)
    n_transfer = config.transfer_tokens // config.seq_len
    transfer_blocks, lora_blocks = blocks[:n_transfer], blocks[n_transfer:]
    if not args.no_control:
        # The control: the same stage-2 LoRA (rank, lr, tokens, text) on the unmodified model. With next-token
        # loss part of stage 2's gain is adaptation to the training text; this row separates it out (with the
        # KL loss the control distils the original from itself: about 1.0x by construction).
        t0 = time.perf_counter()
        control, control_report = finetune_lora(copy.deepcopy(model), lora_blocks, config, progress=True)
        results["timings_s"]["control_lora"] = time.perf_counter() - t0
        results["control_lora"] = {k: v for k, v in control_report.items() if k != "loss_history"}
        record("control", control)
        del control
    model, report = linearize(model, config, transfer_blocks, lora_blocks, progress=True,
                              work_dir=args.out / "transfer-cache", on_stage=record)
    results["timings_s"].update({f"linearize_{k}": v for k, v in report["timings_s"].items()})
    results["transfer_mse"] = report.get("transfer", {}).get("layers")
    results["lora"] = {k: v for k, v in report.get("lora", {}).items() if k != "loss_history"}
    accounting = account(model)
    results["kv_bytes_per_token"] = accounting.kv_bytes_per_token
    results["params"] = accounting.params_dict()

    save(model, args.out / "model", tokenizer=tokenizer, metadata={"method": "lolcats", "config": config.to_dict()},
         overwrite=True)
    reloaded, reloaded_tokenizer = load(args.out / "model")
    prompt = reloaded_tokenizer("The history of the city begins", return_tensors="pt")
    generated = reloaded.generate(**prompt, max_new_tokens=24, do_sample=False)
    results["sample_generation"] = reloaded_tokenizer.decode(generated[0], skip_special_tokens=True)
    results["timings_s"]["total"] = time.perf_counter() - start
    results["peak_rss_mb"] = peak_rss_mb()  # of the training run: recorded before the decode benchmark
    write_json(results, json_path)
    print(format_table(results["ppl_by_stage"]))
    print(f"wall {results['timings_s']['total']:.0f}s, peak RSS {results['peak_rss_mb']:.0f} MiB")
    print(results["sample_generation"])

    contexts = [int(n) for n in args.decode_contexts.split(",") if n]
    if contexts:
        original, _ = load_model(args.model)
        bench = bench_models([("original", original, tokenizer), ("lolcats", reloaded, reloaded_tokenizer)],
                             prefill_len=512, contexts=contexts, decode_tokens=args.decode_tokens,
                             repeats=1, warmup=1, progress=True)
        results["decode_bench"] = bench
        write_json(results, json_path)
        print(format_bench_table(bench))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
