"""LoLCATs at scale: 2 processes (torchrun, gloo) give the losses of 1 — block-wise stage 1 spreads the layers,
stage 2 (LoRA) averages the gradients of the processes' batches, under DDP (accelerate) and under FSDP2
(``fully_shard``: the student's weights sharded, merged from the gathered full tensors)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import retrofitter

WORKER = Path(__file__).with_name("lolcats_worker.py")


def test_two_processes_give_the_losses_of_one(tmp_path):
    sys.path.insert(0, str(WORKER.parent))
    from lolcats_worker import run

    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = run(tmp_path / "one", lora_batch=4)  # one process: LoRA batches of 4
    source = str(Path(retrofitter.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(WORKER), str(tmp_path / "two"), "2"],  # two processes × batches of 2
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / "two" / f"rank{r}.json").read_text()) for r in range(2)]
    assert one["processes"] == 1 and all(r["processes"] == 2 for r in ranks)
    # stage 1: every layer trained by one process on all the cached batches -> the same MSE per epoch
    for layer, history in one["transfer_mse"].items():  # int keys here, str keys through JSON
        for rank in ranks:
            assert rank["transfer_mse"][str(layer)] == pytest.approx(history, rel=1e-5)
    # stage 2: the mean of the two processes' batch losses is the loss of the one-process batch of 4
    mean_losses = [(a + b) / 2 for a, b in zip(ranks[0]["lora_losses"], ranks[1]["lora_losses"])]
    assert len(mean_losses) == len(one["lora_losses"]) == 2
    assert mean_losses == pytest.approx(one["lora_losses"], rel=1e-5)
    # FSDP2 stage 2: the same losses, the same merged weights on every process (the clipping of DTensor gradients
    # acts on the second Adam step, whose update depends on the ratio of the two clipped gradients)
    fsdp_means = [(a + b) / 2 for a, b in zip(ranks[0]["fsdp_losses"], ranks[1]["fsdp_losses"])]
    assert len(fsdp_means) == len(one["fsdp_losses"]) == 2
    assert fsdp_means == pytest.approx(one["fsdp_losses"], rel=1e-5)
    assert all(r["fsdp_trainable"] == one["fsdp_trainable"] for r in ranks)  # whole tensors counted, not shards
    # each process holds about half the student (dim-0 shards, ⌈n/2⌉ rows on rank 0), DDP all of it
    assert sum(r["fsdp_held"] for r in ranks) == one["fsdp_held"] == ranks[0]["ddp_held"]
    assert all(r["fsdp_held"] < 0.6 * one["fsdp_held"] for r in ranks)
    reference = load_file(tmp_path / "one" / "merged_rank0.safetensors")
    for r in range(2):
        merged = load_file(tmp_path / "two" / f"merged_rank{r}.safetensors")
        assert set(merged) == set(reference)
        worst = max(float((merged[k] - reference[k]).abs().max()) for k in reference)
        print(f"rank {r}: merged weights max |diff| vs one process = {worst:.2e}")
        assert worst < 1e-5
    before = load_file(tmp_path / "one" / "before_rank0.safetensors")
    adapted = [k for k in reference if k.endswith("q_proj.weight")]
    assert adapted and all(not torch.equal(reference[k], before[k]) for k in adapted)  # LoRA merged into them
