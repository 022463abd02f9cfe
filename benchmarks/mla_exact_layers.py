"""Where an MLA model loses retrieval: the original (exact) attention put back into a few of its layers.

A diagnostic, not a conversion: each converted MLA layer ``l`` in turn gets the original model's attention
back (same weights the conversion started from; the rest of the MLA model as it is) and the mean log-likelihood
of the answers of teacher-forced retrieval probes (``api.recall_probes``: a 5-digit key hidden in wiki-calib
text) is measured,

    gain_l = mean_p log p(answer_p | prompt_p; layer l exact) - mean_p log p(answer_p | prompt_p; all MLA),

then the ``k`` layers of largest gain are put back together and greedy passkey accuracy (``eval --passkey``'s
trials) is measured at each context length. A layer put back caches the original's 2·n_kv·d_h numbers per
token instead of the MLA layer's kv_rank + rope_dim, so the record also gives the cache of each mix.

    python benchmarks/mla_exact_layers.py runs/mla-0.25-q-healed --counts 1,2,3,6 --contexts 512,1024,2048 \\
        --json benchmarks/results/mla_exact_layers.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from common import machine_info

from retrofitter.adapters import adapter_for
from retrofitter.api import load_model, recall_probes
from retrofitter.eval.passkey import passkey_accuracy
from retrofitter.pipelines.recall_layers import answer_logprob


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mla_model", help="a saved `retrofitter mla` model (healed or not)")
    parser.add_argument("--original", default="smollm2-135m", help="the model it was converted from")
    parser.add_argument("--counts", default="1,2,3,6", help="how many layers to put back, comma-separated")
    parser.add_argument("--contexts", default="512,1024,2048", help="passkey context lengths")
    parser.add_argument("--trials", type=int, default=1, help="random keys per context and depth (3 depths)")
    parser.add_argument("--probes", type=int, default=4, help="retrieval probes for the ranking")
    parser.add_argument("--probe-tokens", type=int, default=512, help="tokens per retrieval probe")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    counts = [int(c) for c in args.counts.split(",")]
    contexts = tuple(int(c) for c in args.contexts.split(","))
    start = time.perf_counter()

    original, tokenizer = load_model(args.original)
    model, _ = load_model(args.mla_model)
    adapter = adapter_for(model)
    mla_layers, original_layers = adapter.decoder_layers(model), adapter.decoder_layers(original)
    converted = [adapter.attention(layer) for layer in mla_layers]
    exact = [adapter.attention(layer) for layer in original_layers]
    mla_numbers = [attention.cache_numbers_per_token() for attention in converted]
    layout = adapter.attention_layout(original)
    exact_numbers = 2 * layout.n_kv_heads * layout.head_dim

    def put_back(layers: set[int]) -> None:
        for index, layer in enumerate(mla_layers):
            adapter.set_attention(layer, exact[index] if index in layers else converted[index])

    probes = recall_probes(tokenizer, count=args.probes, context_tokens=args.probe_tokens)
    baseline, reference = answer_logprob(model, probes), answer_logprob(original, probes)
    gains = {}
    for index in range(len(mla_layers)):
        put_back({index})
        gains[index] = answer_logprob(model, probes) - baseline
    put_back(set())
    order = sorted(gains, key=gains.get, reverse=True)
    print(f"answer log-likelihood: MLA {baseline:.2f}, original {reference:.2f}; largest gains "
          + ", ".join(f"layer {i} +{gains[i]:.2f}" for i in order[:6]), flush=True)

    record = {"model": args.mla_model, "original": args.original, "machine": machine_info(),
              "settings": {**vars(args), "depths": [0.1, 0.5, 0.9]},
              "answer_logprob": {"mla": baseline, "original": reference}, "gains": gains, "order": order, "mixes": {}}
    for count in [0, *counts]:
        layers = set(order[:count])
        put_back(layers)
        numbers = sum(exact_numbers if i in layers else n for i, n in enumerate(mla_numbers))
        passkey = passkey_accuracy(model, tokenizer, context_lengths=contexts, trials=args.trials)
        record["mixes"][count] = {"exact_layers": sorted(layers), "answer_logprob": answer_logprob(model, probes),
                                  "cache_ratio": numbers / (exact_numbers * len(mla_layers)),
                                  "passkey": passkey["by_context"], "passkey_trials": passkey["trials"]}
        row = record["mixes"][count]
        print(f"{count} exact {sorted(layers)}: cache {row['cache_ratio']:.3f}x, answer log-likelihood "
              f"{row['answer_logprob']:.2f}, passkey {row['passkey']}", flush=True)
        record["seconds"] = time.perf_counter() - start
        with open(args.json, "w") as handle:
            json.dump(record, handle, indent=1)
    put_back(set())


if __name__ == "__main__":
    main()
