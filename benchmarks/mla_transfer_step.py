"""One attention-transfer step of an MLA layer, timed per execution and dtype, interleaved.

The step is what ``retrofitter mla --transfer-epochs`` repeats per layer (pipelines/mla_transfer.py): the MLA
module's forward on a batch of calibration blocks, the squared error against a target, backward, one Adam step.
Four settings on the same module and inputs (the layer's real attention inputs on wiki-calib text), in rounds
so that drift of the machine hits each alike:

* ``absorbed`` float32: the serving execution (SDPA over the shared key [c, k_pe], value = key), the transfer's
  step before the decompressed execution existed;
* ``decompressed`` float32: the transfer's default execution (modules/mla_attention.py);
* ``decompressed`` bfloat16: the same under bfloat16 autocast (``--transfer-dtype bfloat16``);
* ``absorbed`` bfloat16: the serving execution under bfloat16 autocast (``--transfer-execution absorbed
  --transfer-dtype bfloat16``): one fused SDPA, no [n, n] scores kept for the backward;
* with ``--original MODEL`` also ``decompressed`` bfloat16 + KL (``--transfer-kl``): the step with the attention-KL
  term against the original model's weights at every 4th query, kept from before the steps as the transfer keeps
  them.

    python benchmarks/mla_transfer_step.py runs/mla-0.5 --layer 10 --json benchmarks/results/mla_transfer_step.json
    python benchmarks/mla_transfer_step.py runs/mla-0.5 --layer 10 --blocks 1 --seq-len 4096 \
        --json benchmarks/results/mla_transfer_step_L4096.json
    python benchmarks/mla_transfer_step.py runs/mla-0.5 --layer 10 --blocks 1 --seq-len 2048 \
        --original smollm2-135m --json benchmarks/results/mla_transfer_step_kl.json

It prints the median step time of each and its ratio to the first; the weights are put back after every step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from common import machine_info

from retrofitter.adapters import adapter_for
from retrofitter.adapters.mla_attention import attention_probabilities
from retrofitter.api import evaluation_blocks, load_model
from retrofitter.pipelines.mla_transfer import attention_kl, kl_query_rows

SETTINGS = (("absorbed", "float32", False), ("decompressed", "float32", False), ("decompressed", "bfloat16", False),
            ("absorbed", "bfloat16", False))
KL_SETTING = ("decompressed", "bfloat16", True)


def layer_inputs(model, layer_index: int, ids: torch.Tensor) -> dict:
    """The keyword arguments the attention of decoder layer ``layer_index`` receives for ``ids`` [b, n]."""
    attention = adapter_for(model).attention(adapter_for(model).decoder_layers(model)[layer_index])
    seen = {}

    def record(_module, args, kwargs):
        seen.update(kwargs, hidden_states=args[0] if args else kwargs["hidden_states"])

    handle = attention.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    return {k: v for k, v in seen.items() if k not in ("past_key_values", "cache", "past_key_value")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mla_model", help="a saved `retrofitter mla` model")
    parser.add_argument("--layer", type=int, default=10, help="the decoder layer whose attention is trained")
    parser.add_argument("--blocks", type=int, default=4, help="calibration blocks per step (--transfer-batch)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=6, help="rounds of one step per setting (after one warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--original", help="the original model: adds the step with the attention-KL term")
    parser.add_argument("--json", help="write the record here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.mla_model)
    model.eval()
    ids = evaluation_blocks(tokenizer, "wiki-calib", args.seq_len, args.blocks * args.seq_len)[:args.blocks]
    inputs = layer_inputs(model, args.layer, ids)
    module = adapter_for(model).attention(adapter_for(model).decoder_layers(model)[args.layer])
    with torch.no_grad():
        target = module(**inputs)[0] * 1.1  # any target: the time does not depend on it
    settings = SETTINGS + ((KL_SETTING,) if args.original else ())
    rows_read = kl_query_rows(args.seq_len)
    if args.original:
        original, _ = load_model(args.original)
        teacher = adapter_for(original).attention(adapter_for(original).decoder_layers(original)[args.layer])
        reference = attention_probabilities(original, teacher, layer_inputs(original, args.layer, ids))[:, :, rows_read]
    described = module.extra_repr()  # before the steps switch its execution
    parameters = list(module.parameters())
    saved = [p.detach().clone() for p in parameters]
    optimizer = torch.optim.Adam(parameters, lr=1e-4)

    def step(execution: str, dtype: str, kl: bool) -> float:
        module.execution = execution
        start = time.perf_counter()
        with torch.enable_grad(), torch.autocast("cpu", dtype=getattr(torch, dtype), enabled=dtype != "float32"):
            out, weights = module(**inputs)[:2]
        loss = (out.float() - target).pow(2).mean()
        if kl:
            loss = loss + attention_kl(reference, weights[:, :, rows_read])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        seconds = time.perf_counter() - start
        with torch.no_grad():
            for p, value in zip(parameters, saved):
                p.copy_(value)
        return seconds

    for p in parameters:
        p.requires_grad_(True)
    module.train()
    times = {setting: [] for setting in settings}
    for setting in settings:
        step(*setting)  # warm-up
    for _ in range(args.rounds):
        for setting in settings:
            times[setting].append(step(*setting))
    medians = {setting: statistics.median(values) for setting, values in times.items()}
    base = medians[settings[0]]
    rows = []
    module.execution = "absorbed"
    print(f"{args.mla_model} layer {args.layer} ({described}), {args.blocks} x {args.seq_len} tokens, "
          f"{args.threads} threads, {args.rounds} interleaved rounds")
    for (execution, dtype, kl), median in medians.items():
        rows.append({"execution": execution, "dtype": dtype, "attention_kl": kl, "median_s": median,
                     "ratio": median / base, "times_s": times[(execution, dtype, kl)]})
        print(f"  {execution:12s} {dtype:8s} {'+ KL' if kl else '':4s} {median * 1e3:7.1f} ms  {median / base:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.mla_model, "original": args.original, "layer": args.layer, "blocks": args.blocks,
                       "seq_len": args.seq_len, "threads": args.threads, "rounds": args.rounds, "module": described,
                       "machine": machine_info(), "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
