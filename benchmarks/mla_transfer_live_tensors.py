"""Live tensor bytes at each layer's attention transfer of `retrofitter mla`: does anything outlive a layer?

Converts MODEL with a short transfer (``--blocks`` calibration blocks of wiki-calib, 1 epoch, ``--transfer-context``)
and, right before each layer's transfer starts, counts the bytes of every distinct tensor storage Python can reach
(``gc`` after a collection). The stream is the same size at every layer, so the count should change only by what the
new MLA module weighs against the attention it replaces; a count that climbs layer by layer is a tensor kept past its
layer (the transfer's gradients did, one copy of each trained module's weights, before ``adam_epochs`` freed them).
The process's peak resident memory (``ru_maxrss``) is reported beside it.

    python benchmarks/mla_transfer_live_tensors.py smollm2-135m --blocks 16 \
        --json benchmarks/results/mla_transfer_live_tensors.json
"""

from __future__ import annotations

import argparse
import gc
import json
import resource

import torch
from common import machine_info

from retrofitter.api import evaluation_blocks, load_model
from retrofitter.eval.bench import cache_nbytes
from retrofitter.pipelines import mla as mla_pipeline
from retrofitter.pipelines.mla import MLAConfig, convert_to_mla


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor ``gc`` tracks, after a collection (``cache_nbytes``' walk)."""
    gc.collect()
    return cache_nbytes([obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--kv-ratio", type=float, default=0.25)
    parser.add_argument("--blocks", type=int, default=16, help="calibration blocks of --seq-len tokens")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--transfer-context", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    blocks = evaluation_blocks(tokenizer, "wiki-calib", args.seq_len, args.blocks * args.seq_len)
    counts = []
    transfer = mla_pipeline.transfer_attention

    def counting(module, batches, **kwargs):  # the pipeline's own transfer, after a count
        counts.append(live_tensor_bytes())
        print(f"layer {len(counts) - 1}: {counts[-1] / 2**20:.1f} MiB of live tensors", flush=True)
        return transfer(module, batches, **kwargs)

    mla_pipeline.transfer_attention = counting
    try:
        config = MLAConfig(kv_ratio=args.kv_ratio, transfer_epochs=1, transfer_context=args.transfer_context,
                           rope_step=1)
        convert_to_mla(model, config, blocks, progress=False)
    finally:
        mla_pipeline.transfer_attention = transfer
    record = {"settings": vars(args), "machine": machine_info(), "live_tensor_bytes_per_layer": counts,
              "growth_bytes": counts[-1] - counts[0],
              "peak_resident_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    print(f"live tensors: {counts[0] / 2**20:.1f} MiB at layer 0, {counts[-1] / 2**20:.1f} MiB at layer "
          f"{len(counts) - 1}; peak resident {record['peak_resident_bytes'] / 2**30:.2f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
