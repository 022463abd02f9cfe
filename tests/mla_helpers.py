"""Tiny MLA models for the MLA tests: a converted tiny model, the execution switch, full and stepwise logits."""

from __future__ import annotations

import torch

from retrofitter.modules.mla_attention import MLAAttention
from retrofitter.pipelines.mla import MLAConfig, convert_to_mla
from tiny_models import TINY_VOCAB, strong_tiny

CALIBRATION = torch.randint(3, TINY_VOCAB, (6, 32), generator=torch.Generator().manual_seed(1))


def converted_mla(family, kv_ratio=0.5, dtype=torch.float64, rope_fraction=0.5, selection="progression", fold=False):
    model = strong_tiny(family, dtype=dtype)
    convert_to_mla(model, MLAConfig(kv_ratio=kv_ratio, rope_fraction=rope_fraction, rope_selection=selection,
                                    damping=1e-9, fold_up_projections=fold), CALIBRATION, progress=False)
    return model


def set_execution(model, execution: str) -> None:
    for module in model.modules():
        if isinstance(module, MLAAttention):
            module.execution = execution


def full_and_stepwise(model, ids, mask):
    """Logits of one full forward and of one token at a time through the cache."""
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits
        cache, steps = None, []
        for t in range(ids.shape[1]):
            out = model(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    return full, torch.cat(steps, 1)
