"""LoLCATs stage 1 (block-wise) and stage 2 (LoRA) on a tiny model, in this process or as one rank of a torchrun
launch: ``python lolcats_worker.py OUT_DIR LORA_BATCH``; writes OUT_DIR/rank<r>.json with the losses."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_models

from tiny_models import TINY_VOCAB, build_tiny  # noqa: E402

from retrofitter.config import LinearizeConfig  # noqa: E402
from retrofitter.pipelines.linearize import attention_transfer, swap_attention  # noqa: E402
from retrofitter.pipelines.lora import lora_finetune  # noqa: E402
from retrofitter.pipelines.training import make_accelerator  # noqa: E402


def run(out: Path, lora_batch: int) -> dict:
    """Stage 1 block-wise (batch 2, layers spread over the processes), stage 2 with ``lora_batch`` per process."""
    accelerator = make_accelerator("cpu")
    config = LinearizeConfig(window=4, feature_dim=8, seq_len=32, batch_size=2, transfer_epochs=2, transfer_lr=1e-2,
                             lora_lr=1e-2, grad_clip=0.0, transfer_mode="blockwise", keep_softmax_layers=(),
                             lora_loss="next_token")  # a loss of real size: KL to itself starts at 0
    model = build_tiny("llama")
    swap_attention(model, config)
    data = torch.randint(3, TINY_VOCAB, (8, 32), generator=torch.Generator().manual_seed(0))
    transfer = attention_transfer(model, data, config, accelerator, progress=False, work_dir=out / "work")
    lora_config = LinearizeConfig(**{**config.to_dict(), "batch_size": lora_batch})
    _, lora = lora_finetune(model, data, lora_config, accelerator, progress=False)
    report = {"processes": accelerator.num_processes, "transfer_mse": transfer["train_mse_history"],
              "lora_losses": lora["loss_history"]}
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(report))
    accelerator.wait_for_everyone()
    return report


if __name__ == "__main__":
    run(Path(sys.argv[1]), int(sys.argv[2]))
