"""LoLCATs stage 1 (block-wise) and stage 2 (LoRA, under DDP and under FSDP2) on a tiny model, in this process or
as one rank of a torchrun launch: ``python lolcats_worker.py OUT_DIR LORA_BATCH``; writes OUT_DIR/rank<r>.json
with the losses and OUT_DIR/merged_rank<r>.safetensors with the FSDP2 run's merged weights."""

import copy
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_models

from tiny_models import TINY_VOCAB, build_tiny  # noqa: E402

from retrofitter.config import LinearizeConfig  # noqa: E402
from retrofitter.pipelines.linearize import attention_transfer, swap_attention  # noqa: E402
from retrofitter.pipelines.lora import lora_finetune  # noqa: E402
from retrofitter.pipelines.training import make_accelerator  # noqa: E402


def _save(model, path: Path) -> None:
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(path))


def run(out: Path, lora_batch: int) -> dict:
    """Stage 1 block-wise (batch 2, layers spread over the processes), then stage 2 with ``lora_batch`` per
    process twice from the same model (next-token loss): DDP without clipping, FSDP2 with gradient clipping."""
    torch.set_num_threads(1)
    accelerator = make_accelerator("cpu")
    config = LinearizeConfig(window=4, feature_dim=8, seq_len=32, batch_size=2, transfer_epochs=2, transfer_lr=1e-2,
                             lora_lr=1e-2, grad_clip=0.0, transfer_mode="blockwise", keep_softmax_layers=(),
                             lora_loss="next_token")  # a loss of real size: KL to itself starts at 0
    model = build_tiny("llama")
    swap_attention(model, config)
    data = torch.randint(3, TINY_VOCAB, (8, 32), generator=torch.Generator().manual_seed(0))
    transfer = attention_transfer(model, data, config, accelerator, progress=False, work_dir=out / "work")
    rank = accelerator.process_index
    _save(model, out / f"before_rank{rank}.safetensors")
    ddp_config = LinearizeConfig(**{**config.to_dict(), "batch_size": lora_batch})
    _, ddp = lora_finetune(copy.deepcopy(model), data, ddp_config, accelerator, progress=False)
    fsdp_config = LinearizeConfig(**{**ddp_config.to_dict(), "grad_clip": 0.5, "lora_sharding": "fsdp"})
    merged, fsdp = lora_finetune(model, data, fsdp_config, accelerator, progress=False)
    report = {"processes": accelerator.num_processes, "transfer_mse": transfer["train_mse_history"],
              "lora_losses": ddp["loss_history"], "fsdp_losses": fsdp["loss_history"],
              "fsdp_trainable": fsdp["trainable_parameters"],
              "fsdp_held": fsdp["parameters_per_process"], "ddp_held": ddp["parameters_per_process"]}
    _save(merged, out / f"merged_rank{rank}.safetensors")
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    accelerator.wait_for_everyone()
    return report


if __name__ == "__main__":
    run(Path(sys.argv[1]), int(sys.argv[2]))
