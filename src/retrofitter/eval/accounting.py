"""Parameter, MAC and byte accounting of a causal LM (any architecture; exact for adapted families).

* ``params_total``: unique parameters (tied embeddings counted once);
* ``params_embedding``: token/position embeddings (every ``nn.Embedding``) and the LM head;
* ``params_linear``: parameters of the decoder layers' projections (the compressible part);
* ``macs_per_token``: multiply-accumulates of every matmul weight used once per token (projections and
  LM head); attention score/mixing MACs grow with context and are given separately at a context ``n``
  as ``attention_macs_per_token`` (average over the n positions of a causal window: n/2 keys);
* ``kv_bytes_per_token``: bytes a decoding cache grows by per token, Σ over layers of the attention
  module's own ``cache_bytes_per_token()`` (latent attention: latents + position ids) or
  ``cache_numbers_per_token()`` · dtype bytes (constant-state attention: 0); otherwise standard
  attention stores 2 · n_kv_heads · head_dim numbers per layer;
* ``state_bytes_per_sequence``: bytes of the constant-size decode state of one sequence, Σ over
  layers of ``state_bytes(1)`` (hybrid attention: ring buffer + S, z in their real dtypes), 0 for
  softmax layers. A cache after ``n`` tokens holds ``state_bytes_per_sequence + n · kv_bytes_per_token``
  bytes per sequence;
* ``stored_bytes``: bytes of every tensor of the state dict (parameters and persistent buffers, e.g.
  ``LatentLinear`` index buffers; tied tensors once) — what ``save_pretrained`` writes to safetensors;
  a quantized weight (``modules.quantize``) counts its int8 data, scales and zero points.

Models without an adapter (``account_generic``): parameters from module types (projections = every
``nn.Linear`` except the LM head), KV bytes and attention MACs from the config assuming standard
softmax attention (2 · layers · n_kv_heads · head_dim · dtype bytes); a figure that cannot be known is
None and ``notes`` says why.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..adapters import UnsupportedArchitectureError, adapter_for

__all__ = ["Accounting", "account", "account_generic", "stored_bytes", "tensor_bytes", "tensor_leaves"]


@dataclass(frozen=True)
class Accounting:
    params_total: int
    params_linear: int
    params_embedding: int
    macs_per_token: int | None
    attention_macs_per_token: int | None
    context_for_attention_macs: int
    kv_bytes_per_token: int | None
    state_bytes_per_sequence: int | None
    stored_bytes: int
    dtype: str
    notes: tuple[str, ...] = ()  # why a figure is None or only estimated

    def params_dict(self) -> dict:
        return {"total": self.params_total, "linear": self.params_linear, "embedding": self.params_embedding}

    def bytes_dict(self) -> dict:
        """Byte figures: ``stored`` (state dict), ``kv_per_token`` (cache growth), ``state_per_sequence``."""
        return {"stored": self.stored_bytes, "kv_per_token": self.kv_bytes_per_token,
                "state_per_sequence": self.state_bytes_per_sequence}

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


def tensor_leaves(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``tensor``'s data: itself, or for a wrapper tensor subclass (torchao's
    ``Int8Tensor``: int8 ``qdata`` [n, k], ``scale`` [n, 1], ``zero_point`` [n, 1]) its inner tensors
    (``__tensor_flatten__``), recursively."""
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return [leaf for name in names for leaf in tensor_leaves(getattr(tensor, name))]
    return [tensor]


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes ``tensor`` stores: Σ numel · element size over its ``tensor_leaves``."""
    return sum(leaf.numel() * leaf.element_size() for leaf in tensor_leaves(tensor))


def stored_bytes(model: nn.Module) -> int:
    """Σ ``tensor_bytes`` over the state dict's tensors, each tensor once (tied weights share one)."""
    unique = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    return sum(tensor_bytes(t) for t in unique.values())


def _embedding_modules(model: nn.Module) -> list[nn.Module]:
    modules = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    for extra in (model.get_input_embeddings(), model.get_output_embeddings()):
        if extra is not None and all(extra is not m for m in modules):
            modules.append(extra)
    return modules


def _matmul_macs(module: nn.Module) -> int:
    """MACs per token of a projection: its weight count (a Linear) or its own declared figure."""
    if hasattr(module, "macs_per_token"):
        return int(module.macs_per_token())
    if hasattr(module, "num_weight_params"):  # factored layers: each stored weight is used once per token
        return int(module.num_weight_params())
    if isinstance(module, nn.Linear):
        return module.in_features * module.out_features
    raise TypeError(f"cannot count MACs of {type(module).__name__}")


def _layer_cache_bytes(attention: nn.Module, n_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    if hasattr(attention, "cache_bytes_per_token"):
        return int(attention.cache_bytes_per_token())
    if hasattr(attention, "cache_numbers_per_token"):
        return int(attention.cache_numbers_per_token()) * dtype_bytes
    return 2 * n_kv_heads * head_dim * dtype_bytes


def account(model: nn.Module, context: int = 512) -> Accounting:
    """Accounting of ``model``; attention MACs at a causal context of ``context`` tokens.

    Architectures without an adapter are accounted by :func:`account_generic`.
    """
    try:
        adapter = adapter_for(model)
    except UnsupportedArchitectureError:
        return account_generic(model, context)
    layout = adapter.attention_layout(model)
    layers = adapter.decoder_layers(model)
    dtype = next(model.parameters()).dtype
    dtype_bytes = next(model.parameters()).element_size()

    head = model.get_output_embeddings()
    projections = [m for layer in layers for m in _layer_projections(adapter, layer)]
    macs = sum(_matmul_macs(m) for m in projections)
    macs += sum(int(getattr(adapter.attention(layer), "extra_macs_per_token", lambda: 0)()) for layer in layers)
    if head is not None:
        macs += head.weight.numel()

    kv_bytes = state_bytes = attention_macs = 0
    for layer in layers:
        attention = adapter.attention(layer)
        kv_bytes += _layer_cache_bytes(attention, layout.n_kv_heads, layout.head_dim, dtype_bytes)
        if hasattr(attention, "state_bytes"):
            state_bytes += int(attention.state_bytes(1))
        if hasattr(attention, "attention_macs_per_token"):
            attention_macs += int(attention.attention_macs_per_token(context))
        else:
            # q·k and p·v for each query head over on average context/2 keys
            attention_macs += 2 * layout.n_heads * layout.head_dim * (context // 2)
    return Accounting(
        params_total=_unique_param_count([model]),
        params_linear=_unique_param_count(projections),
        params_embedding=_unique_param_count(_embedding_modules(model)),
        macs_per_token=macs,
        attention_macs_per_token=attention_macs,
        context_for_attention_macs=context,
        kv_bytes_per_token=kv_bytes,
        state_bytes_per_sequence=state_bytes,
        stored_bytes=stored_bytes(model),
        dtype=str(dtype).replace("torch.", ""),
    )


def _layer_projections(adapter, layer: nn.Module) -> list[nn.Module]:
    """The layer's projections: the adapter's, except that an attention module listing its own
    (``linear_projections()``: MLA's q, kv_a, k_pe, o) replaces the adapter's q/k/v/o."""
    attention = adapter.attention(layer)
    if not hasattr(attention, "linear_projections"):
        return [adapter.get_linear(layer, name) for name in adapter.linear_names]
    prefix = f"{adapter.attention_path}."
    others = [adapter.get_linear(layer, name) for name in adapter.linear_names
              if not adapter.linear_paths[name].startswith(prefix)]
    return list(attention.linear_projections()) + others


def _config_attention(config) -> tuple[int, int, int, int] | None:
    """(layers, n_heads, n_kv_heads, head_dim) from an HF config, or None when a field is missing."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    layers = getattr(config, "num_hidden_layers", None)
    n_heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    head_dim = getattr(config, "head_dim", None) or (hidden // n_heads if hidden and n_heads else None)
    if not (layers and n_heads and head_dim):
        return None
    n_kv_heads = getattr(config, "num_key_value_heads", None) or n_heads
    return int(layers), int(n_heads), int(n_kv_heads), int(head_dim)


def account_generic(model: nn.Module, context: int = 512) -> Accounting:
    """Accounting of any HF causal LM from module types and its config (see the module docstring)."""
    first = next(model.parameters())
    name = type(model).__name__
    notes = [f"no adapter for {name}: projections = nn.Linear modules, cache figures from the config "
             "assuming standard softmax attention"]
    head = model.get_output_embeddings()
    embeddings = _embedding_modules(model)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m is not head]

    covered = {id(p) for m in [*embeddings, *linears] for p in m.parameters()}
    uncovered = [n for n, p in model.named_parameters() if p.ndim >= 2 and id(p) not in covered]
    macs = None
    if uncovered:
        listed = ", ".join(uncovered[:3]) + (", ..." if len(uncovered) > 3 else "")
        notes.append(f"macs_per_token unknown: matrices outside nn.Linear/nn.Embedding ({listed})")
    else:
        macs = sum(m.weight.numel() for m in linears) + (head.weight.numel() if head is not None else 0)

    kv_bytes = state_bytes = attention_macs = None
    shape = _config_attention(model.config)
    if shape is None:
        notes.append("kv_bytes_per_token, state_bytes_per_sequence and attention MACs unknown: the config "
                     "lacks num_hidden_layers / num_attention_heads / hidden_size (or head_dim)")
    else:
        layers, n_heads, n_kv_heads, head_dim = shape
        kv_bytes = layers * 2 * n_kv_heads * head_dim * first.element_size()
        state_bytes = 0
        attention_macs = layers * 2 * n_heads * head_dim * (context // 2)
    return Accounting(
        params_total=_unique_param_count([model]),
        params_linear=_unique_param_count(linears),
        params_embedding=_unique_param_count(embeddings),
        macs_per_token=macs,
        attention_macs_per_token=attention_macs,
        context_for_attention_macs=context,
        kv_bytes_per_token=kv_bytes,
        state_bytes_per_sequence=state_bytes,
        stored_bytes=stored_bytes(model),
        dtype=str(first.dtype).replace("torch.", ""),
        notes=tuple(notes),
    )
