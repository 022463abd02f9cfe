"""Parameter, MAC and KV-cache accounting.

* ``params.total``: unique parameters (tied embeddings counted once);
* ``params.embedding``: token/position embeddings and an untied LM head;
* ``params.linear``: parameters of the decoder layers' projections (the compressible part);
* ``macs_per_token``: multiply-accumulates of every matmul weight used once per token (projections and
  LM head); attention score/mixing MACs grow with context and are given separately at a context ``n``
  as ``attention_macs_per_token`` (average over the n positions of a causal window: n/2 keys);
* ``kv_bytes_per_token``: bytes a decoding cache grows by per token. A module can declare its own
  figure with a method ``cache_numbers_per_token()`` (latent or constant-state attention); otherwise
  standard attention stores 2 · n_kv_heads · head_dim numbers per layer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..adapters import adapter_for

__all__ = ["Accounting", "account"]


@dataclass(frozen=True)
class Accounting:
    params_total: int
    params_linear: int
    params_embedding: int
    macs_per_token: int
    attention_macs_per_token: int
    context_for_attention_macs: int
    kv_bytes_per_token: int
    dtype: str

    def params_dict(self) -> dict:
        return {"total": self.params_total, "linear": self.params_linear, "embedding": self.params_embedding}

    def as_dict(self) -> dict:
        return asdict(self)


def _unique_param_count(modules) -> int:
    seen, count = set(), 0
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                count += p.numel()
    return count


def _matmul_macs(module: nn.Module) -> int:
    """MACs per token of a projection: its weight count (a Linear) or its own declared figure."""
    if hasattr(module, "macs_per_token"):
        return int(module.macs_per_token())
    if hasattr(module, "num_weight_params"):  # factored layers: each stored weight is used once per token
        return int(module.num_weight_params())
    if isinstance(module, nn.Linear):
        return module.in_features * module.out_features
    raise TypeError(f"cannot count MACs of {type(module).__name__}")


def account(model: nn.Module, context: int = 512) -> Accounting:
    """Accounting of ``model``; attention MACs at a causal context of ``context`` tokens."""
    adapter = adapter_for(model)
    layout = adapter.attention_layout(model)
    layers = adapter.decoder_layers(model)
    dtype = next(model.parameters()).dtype
    dtype_bytes = torch.finfo(dtype).bits // 8

    embedding_modules = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    head = model.get_output_embeddings()
    if head is not None:
        embedding_modules.append(head)
    params_embedding = _unique_param_count(embedding_modules)
    params_total = _unique_param_count([model])

    projections = [adapter.get_linear(layer, name) for layer in layers for name in adapter.linear_names]
    params_linear = _unique_param_count(projections)
    macs = sum(_matmul_macs(m) for m in projections)
    if head is not None:
        macs += head.weight.numel()

    kv_numbers = 0
    attention_macs = 0
    for layer in layers:
        attention = adapter.attention(layer)
        if hasattr(attention, "cache_numbers_per_token"):
            kv_numbers += int(attention.cache_numbers_per_token())
        else:
            kv_numbers += 2 * layout.n_kv_heads * layout.head_dim
        if hasattr(attention, "attention_macs_per_token"):
            attention_macs += int(attention.attention_macs_per_token(context))
        else:
            # q·k and p·v for each query head over on average context/2 keys
            attention_macs += 2 * layout.n_heads * layout.head_dim * (context // 2)
    return Accounting(
        params_total=params_total,
        params_linear=params_linear,
        params_embedding=params_embedding,
        macs_per_token=macs,
        attention_macs_per_token=attention_macs,
        context_for_attention_macs=context,
        kv_bytes_per_token=kv_numbers * dtype_bytes,
        dtype=str(dtype).replace("torch.", ""),
    )
