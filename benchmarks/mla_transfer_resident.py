"""Peak resident memory of each layer of `retrofitter mla` with a transfer, with and without returning freed heap.

After each layer the MLA pipeline hands the C heap's free pages back to the OS (``release_free_heap_memory``,
glibc's ``malloc_trim(0)``): the layer's inputs, targets and the streams it replaced are freed there, and glibc
otherwise keeps much of that memory, so the resident figure climbs from layer to layer while the live tensors do
not (benchmarks/mla_transfer_live_tensors.py). Each arm converts MODEL in a fresh process (``--blocks``
calibration blocks of wiki-calib, ``--epochs`` transfer epochs, ``--transfer-context``) and samples the resident
set every 0.2 s, attributing each sample to the layer being converted; the ``keep`` arm replaces the call by a
no-op.

    python benchmarks/mla_transfer_resident.py smollm2-135m --blocks 256 --epochs 1 \
        --json benchmarks/results/mla_transfer_resident.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading

from common import machine_info

ARMS = ("trim", "keep")


def run_arm(args: argparse.Namespace) -> dict:
    """One conversion in this process: the peak resident MiB of each layer, sampled every 0.2 s."""
    import psutil
    import torch

    from retrofitter.api import evaluation_blocks, load_model
    from retrofitter.pipelines import mla as mla_pipeline
    from retrofitter.pipelines.mla import MLAConfig, convert_to_mla

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    blocks = evaluation_blocks(tokenizer, "wiki-calib", args.seq_len, args.blocks * args.seq_len)
    if args.arm == "keep":
        mla_pipeline.release_free_heap_memory = lambda: False
    process, layer, peaks, stop = psutil.Process(), [-1], {}, threading.Event()
    transfer = mla_pipeline.transfer_attention

    def counting(module, batches, **kwargs):  # the pipeline's own transfer; marks which layer is running
        layer[0] += 1
        return transfer(module, batches, **kwargs)

    def sample() -> None:
        while not stop.is_set():
            rss = process.memory_info().rss / 2**20
            peaks[layer[0]] = max(peaks.get(layer[0], 0.0), rss)
            stop.wait(0.2)

    mla_pipeline.transfer_attention = counting
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    config = MLAConfig(kv_ratio=args.kv_ratio, transfer_epochs=args.epochs, transfer_context=args.transfer_context,
                       rope_step=1)
    convert_to_mla(model, config, blocks, progress=False)
    stop.set()
    sampler.join()
    return {"peak_resident_mib_per_layer": [round(peaks[i], 1) for i in sorted(peaks) if i >= 0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--kv-ratio", type=float, default=0.25)
    parser.add_argument("--blocks", type=int, default=256, help="calibration blocks of --seq-len tokens")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--transfer-context", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms to run, each in a fresh process")
    parser.add_argument("--arm", choices=ARMS, help="run one arm in this process and print its record (internal)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(run_arm(args)))
        return
    record = {"settings": vars(args), "machine": machine_info(), "arms": {}}
    # a fresh process per arm: what the allocator holds depends on everything the process did
    for arm in args.arms.split(","):
        out = subprocess.run([sys.executable, *sys.argv, "--arm", arm], check=True, capture_output=True, text=True)
        record["arms"][arm] = json.loads(out.stdout.strip().splitlines()[-1])
        peaks = record["arms"][arm]["peak_resident_mib_per_layer"]
        print(f"{arm}: peak resident {peaks[0]:.0f} MiB in layer 0, {max(peaks):.0f} MiB at most "
              f"(layer {peaks.index(max(peaks))}), {peaks[-1]:.0f} MiB in layer {len(peaks) - 1}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
