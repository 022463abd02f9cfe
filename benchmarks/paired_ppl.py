"""Perplexity ratios against a baseline on the same blocks, with a paired 95 % interval over blocks.

Every model is evaluated on the same token blocks of each corpus (the cut of ``retrofitter eval``); for each
model and corpus the record holds its perplexity, the ratio to the baseline's and the interval of
``retrofitter.eval.perplexity.paired_ratio``: d_b = (nll_model[b] − nll_base[b]) / (L − 1), ratio =
exp(mean d), interval exp(mean d ± 1.96·std(d)/√n). Without ``--max-eval-tokens`` a corpus is read whole
(wiki-eval: 281 blocks of 512).

    python benchmarks/paired_ppl.py runs/mla-0.5-q-healed --baseline smollm2-135m --corpora wiki-eval \\
        --json benchmarks/results/mla_0.5_paired_wiki_eval.json
"""

from __future__ import annotations

import argparse
import time

import torch
from common import eval_blocks, machine_info

from retrofitter.api import load_model, write_json
from retrofitter.eval.perplexity import block_nlls, paired_ratio, perplexity_from_nlls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="models to compare with the baseline (aliases, HF or saved dirs)")
    parser.add_argument("--baseline", default="smollm2-135m", help="the model the ratios are taken against")
    parser.add_argument("--corpora", default="wiki-eval", help="comma-separated evaluation corpora")
    parser.add_argument("--seq-len", type=int, default=512, help="perplexity window")
    parser.add_argument("--max-eval-tokens", type=int, default=None, help="cap on tokens per corpus (default: all)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    corpora = args.corpora.split(",")
    baseline, tokenizer = load_model(args.baseline)
    blocks = eval_blocks(tokenizer, corpora, args.seq_len, args.max_eval_tokens)
    base_nll = {name: block_nlls(baseline, b, args.batch_size, description=f"{args.baseline} {name}")
                for name, b in blocks.items()}
    del baseline
    record = {"baseline": args.baseline, "settings": {"seq_len": args.seq_len, "max_eval_tokens": args.max_eval_tokens,
              "blocks": {name: int(b.shape[0]) for name, b in blocks.items()}, "threads": torch.get_num_threads()},
              "machine": machine_info(), "baseline_ppl": {}, "models": {}}
    for name, nll in base_nll.items():
        record["baseline_ppl"][name] = perplexity_from_nlls(nll, args.seq_len).ppl
    rows = []
    for path in args.models:
        model, _ = load_model(path)
        results = {}
        for name, corpus_blocks in blocks.items():
            nll = block_nlls(model, corpus_blocks, args.batch_size, description=f"{path} {name}")
            paired = paired_ratio(base_nll[name], nll, args.seq_len)
            ppl = perplexity_from_nlls(nll, args.seq_len).ppl
            results[name] = {"ppl": ppl, "ratio": paired.ratio, "ci95": [paired.low, paired.high],
                             "log_ratio_se": paired.log_ratio_se, "blocks": paired.blocks}
            rows.append(f"{path:<45} {name:<12} {record['baseline_ppl'][name]:>8.3f} {ppl:>8.3f} "
                        f"{paired.ratio:>7.4f}  [{paired.low:.4f}, {paired.high:.4f}]  {paired.blocks}")
        record["models"][path] = results
        del model
    record["seconds"] = time.perf_counter() - start
    write_json(record, args.json)
    print(f"{'model':<45} {'corpus':<12} {'baseline':>8} {'ppl':>8} {'ratio':>7}  95 % interval      blocks")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
